"""Training kernels beside their torch references (README.md in this folder): TTT attention and the soft
cross-entropy. Triton is optional (``_triton``); every kernel has a torch path that runs anywhere."""
