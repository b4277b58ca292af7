"""`kvserve serve` flags: vLLM's names, the engine options reach the engine, refusals are clear."""

from __future__ import annotations

import pytest

from kvserve.entrypoints import cli


def _parse(*argv):
    return cli.build_parser().parse_args(["serve", *argv])


def test_defaults_and_flag_names():
    args = _parse()
    assert args.model is None and args.host == "127.0.0.1" and args.port == 8000
    assert args.enable_prefix_caching is True and args.kv_cache_dtype == "auto"
    assert args.max_waiting_requests == 1024 and args.api_key is None
    args = _parse("/some/model", "--port", "9000", "--block-size", "32",
                  "--no-enable-prefix-caching", "--max-model-len", "1024", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.5",
                  "--kv-cache-memory-bytes", "1000000", "--seed", "3",
                  "--served-model-name", "a", "b", "--api-key", "k",
                  "--max-waiting-requests", "7")
    assert args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    kwargs = cli.engine_kwargs(args)
    assert kwargs["model"] == "/some/model" and kwargs["block_size"] == 32
    assert kwargs["max_model_len"] == 1024 and kwargs["max_num_seqs"] == 8
    assert kwargs["max_num_batched_tokens"] == 2048
    assert kwargs["kv_cache_memory_bytes"] == 1000000 and kwargs["seed"] == 3


def test_every_engine_config_field_is_a_flag_with_its_default():
    """The engine flags are generated from EngineConfig: none missing, no default drifted."""
    import dataclasses

    from kvserve.config import EngineConfig

    args = _parse()
    kwargs = cli.engine_kwargs(args)
    assert kwargs == {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    args = _parse("--tokenizer", "/tok", "--no-enable-chunked-prefill", "--dtype", "bf16",
                  "--num-threads", "2", "--enforce-eager", "--kv-tier-config", "{}")
    assert (args.tokenizer, args.enable_chunked_prefill, args.dtype) == ("/tok", False, "bf16")
    assert (args.num_threads, args.enforce_eager, args.kv_tier_config) == (2, True, "{}")
    assert _parse("--no-enforce-eager").enforce_eager is False


def test_kv_cache_dtype_names_and_refusal(capsys):
    """vLLM's values plus int8/int4 reach the engine; an unknown one is refused with the list."""
    for name in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"):
        assert cli.engine_kwargs(_parse("--kv-cache-dtype", name))["kv_cache_dtype"] == name
    with pytest.raises(SystemExit) as info:
        _parse("--kv-cache-dtype", "fp6")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'fp6'" in err and "fp8_e5m2" in err and "int4" in err


def test_engine_options_reach_the_engine(monkeypatch):
    from kvserve.engine import async_engine

    seen = {}

    class Stop(Exception):
        pass

    def fake_from_kwargs(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(async_engine.AsyncLLMEngine, "from_kwargs", staticmethod(fake_from_kwargs))
    with pytest.raises(Stop):
        cli.main(["serve", "--no-enable-prefix-caching", "--block-size", "8",
                  "--max-waiting-requests", "5", "--attention-backend", "triton",
                  "--enforce-eager"])
    assert seen["enable_prefix_caching"] is False and seen["block_size"] == 8
    assert seen["max_waiting_requests"] == 5 and seen["model"] is None
    assert seen["device"] == "auto" and seen["attention_backend"] == "triton"
    assert seen["enforce_eager"] is True


def test_invalid_values_exit_with_a_message(capsys):
    assert cli.main(["serve", "--max-waiting-requests", "0"]) == 2
    assert "--max-waiting-requests" in capsys.readouterr().err
    assert cli.main(["serve", "--block-size", "0", "--port", "1"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_served_model_names_follow_vllm():
    """--served-model-name, else the model as given; the embedded default by its own name."""
    from kvserve.server.launch import served_names

    assert served_names(_parse()) == ["SmolLM2-135M-Instruct"]
    assert served_names(_parse("./ckpt")) == ["./ckpt"]
    assert served_names(_parse("x.gguf", "--served-model-name", "a", "b")) == ["a", "b"]
