"""SparseSpec-L: training-free self-speculation over a sparse, recallable view of the target's KV cache."""

from draftlab.methods.sparsespec_l.controller import EntropyController, FixedK
from draftlab.methods.sparsespec_l.drafter import SparseSpecDrafter
from draftlab.methods.sparsespec_l.selection import MassHistory, budget_slots, select_slots

__all__ = ["EntropyController", "FixedK", "MassHistory", "SparseSpecDrafter", "budget_slots", "select_slots"]
