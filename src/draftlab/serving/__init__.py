"""Talking to serving engines: an async OpenAI-compatible client and a server launcher (vLLM, SGLang).

The engines themselves are not draftlab dependencies; they live in their own environments and are started as
subprocesses (``launcher``), then spoken to over HTTP (``client``). ``stub`` is a stand-in server for tests.
"""

from draftlab.serving.client import (
    ChatClient,
    Completion,
    RequestTimeout,
    ServerError,
    ServerUnreachable,
    ServingError,
    get_json,
    parse_completion,
)
from draftlab.serving.launcher import (
    SGLANG_HEALTH,
    VLLM_HEALTH,
    ServerProcess,
    ServerStartError,
    free_port,
    sglang_command,
    vllm_command,
)

__all__ = ["ChatClient", "Completion", "RequestTimeout", "ServerError", "ServerUnreachable", "ServingError",
           "get_json", "parse_completion", "SGLANG_HEALTH", "VLLM_HEALTH", "ServerProcess", "ServerStartError", "free_port",
           "sglang_command", "vllm_command"]
