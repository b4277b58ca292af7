"""The compatibility table (kvserve/utils/features.py): every refusal of a feature combination is one
of its rows, checked in one function, and the config's own combinations are refused at
start-up with the row's reason."""

from __future__ import annotations

import pytest

from kvserve.utils import features as F
from kvserve.config import EngineConfig


def test_every_row_refuses_its_pair_and_nothing_else():
    for row in F.CONFLICTS:
        assert row.a != row.b
        with pytest.raises(ValueError) as err:
            F.check_features({row.a, row.b, "some_other_feature"})
        assert "{" not in str(err.value), "a reason field left unfilled"  # "?" at worst
        with pytest.raises(ValueError):
            F.refuse(row.b, row.a)  # either order
        F.check_features({row.a})  # one feature alone is never refused
        F.check_features({row.b})
    F.check_features(set())


def test_first_row_in_table_order_wins_and_fields_are_filled():
    on = {F.BOUNDED, F.MLA, F.KV_DTYPE_OTHER}
    assert [c.b for c in F.conflicts(on) if c.a == F.BOUNDED] == [F.MLA, F.KV_DTYPE_OTHER]
    with pytest.raises(ValueError, match=r"MLA models \(Deepseek\).*model's dtype \(bf16\)"):
        F.check_features(on, architecture="Deepseek", model_kv="bf16", what="a quantized",
                         kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"layers \[0, 2\] are sliding-window"):
        F.check_features({F.BOUNDED, F.SLIDING_WINDOW}, windowed=[0, 2])


def test_a_pair_outside_the_table_cannot_be_refused():
    with pytest.raises(KeyError):
        F.refuse(F.INT4, F.CUDA)


@pytest.mark.parametrize("kwargs, message", [
    (dict(enable_prefix_caching=False, kv_tier_config={}), "needs prefix caching"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_tier_config={}),
     "calculate_kv_scales cannot be combined"),
    (dict(device="cuda", attention_backend="torch"), "the CPU backend"),
    (dict(device="cpu", attention_backend="triton", kv_cache_dtype="int4"), "torch backend only"),
])
def test_config_combinations_are_refused_from_the_table(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_config_features():
    assert EngineConfig(device="cpu").features() == {F.TORCH_BACKEND}  # auto on a CPU
    on = EngineConfig(device="cpu", kv_cache_dtype="int4", bounded_kv_policy="h2o",
                      bounded_kv_budget=64, enable_prefix_caching=False).features()
    assert on == {F.INT4, F.BOUNDED, F.NO_PREFIX_CACHING, F.TORCH_BACKEND}
