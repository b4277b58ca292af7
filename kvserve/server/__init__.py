"""kvserve's OpenAI-compatible HTTP server (`kvserve serve`): FastAPI + uvicorn in front of an
AsyncLLMEngine whose loop runs in its own thread."""

from kvserve.server.args import add_server_args

__all__ = ["add_server_args", "build_app", "run_server"]


def __getattr__(name):  # the app and the launcher pull in fastapi/uvicorn: import them lazily
    if name == "build_app":
        from kvserve.server.app import build_app

        return build_app
    if name == "run_server":
        from kvserve.server.launch import run_server

        return run_server
    raise AttributeError(name)
