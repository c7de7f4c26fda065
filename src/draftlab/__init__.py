"""draftlab: a research framework for speculative decoding."""

__version__ = "0.1.0"


def _register_config_resolvers() -> None:
    # Config interpolations draftlab's conf/ uses (``${auto_precision:...}``), available wherever it is imported.
    from draftlab.utils.precision import register_resolver

    register_resolver()


_register_config_resolvers()
