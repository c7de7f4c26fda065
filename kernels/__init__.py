"""Kernels for training drafters, each beside a pure-torch reference of the same op (see README.md).

Installed as ``draftlab.kernels`` (``src/draftlab/kernels`` links here); ``triton`` is imported only through
``_triton``, guarded.
"""
