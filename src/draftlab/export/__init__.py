"""``draftlab-export``'s method-agnostic side: dispatch through a method's ``export`` block, and Lightning
checkpoint reading. The formats themselves live with their methods (``draftlab.methods.<m>.export``)."""

from draftlab.export.dispatch import export_checkpoint, load_for_export

__all__ = ["export_checkpoint", "load_for_export"]
