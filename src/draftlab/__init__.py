"""draftlab: a research framework for speculative decoding."""

__version__ = "0.1.0"


def _register_config_resolvers() -> None:
    # Config interpolations draftlab's conf/ uses (``${auto_precision:...}``, ``${method_name:...}``), available
    # wherever it is imported.
    from draftlab.utils.conf import register_resolvers

    register_resolvers()


_register_config_resolvers()
