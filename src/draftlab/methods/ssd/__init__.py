"""SSD / Saguaro: speculative speculative decoding with a worker that prepares the next round during
verification."""

from draftlab.methods.ssd.drafter import SSDDrafter

__all__ = ["SSDDrafter"]
