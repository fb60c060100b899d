"""bf16 only where it is fast (hardware.py): CPUs without AVX512-bf16/AMX emulate it 50-100x
slower than fp32, so every bf16 default asks first."""

import pytest
import torch

from avatarstream import hardware
from avatarstream.errors import ConfigError
from avatarstream.train.recipe import load_recipe


@pytest.fixture
def flags(monkeypatch):
    def set_flags(*names: str) -> None:
        monkeypatch.delenv("AVATARSTREAM_BF16", raising=False)
        monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset(names))
    return set_flags


def test_cpu_bf16_follows_the_flags(flags):
    flags("avx2", "fma")
    assert not hardware.bf16_is_fast("cpu")
    flags("avx2", "avx512f", "avx512_bf16")
    assert hardware.bf16_is_fast("cpu")
    flags("amx_bf16")
    assert hardware.bf16_is_fast("cpu")


def test_env_forces_the_answer(flags, monkeypatch):
    flags("avx2")
    monkeypatch.setenv("AVATARSTREAM_BF16", "1")
    assert hardware.bf16_is_fast("cpu")
    flags("avx512_bf16")
    monkeypatch.setenv("AVATARSTREAM_BF16", "0")
    assert not hardware.bf16_is_fast("cpu")


def test_resolve_setting(flags):
    flags("avx2")
    assert hardware.resolve_bf16("auto") is False
    assert hardware.resolve_bf16(None) is False
    assert hardware.resolve_bf16(True) is True
    flags("avx512_bf16")
    assert hardware.resolve_bf16("auto") is True
    assert hardware.resolve_bf16(False) is False


def test_load_model_autocasts_only_where_fast(flags):
    from avatarstream.registry import load_model

    flags("avx2")
    assert load_model("small-random").dit.autocast_dtype is None
    flags("avx512_bf16")
    assert load_model("small-random").dit.autocast_dtype == torch.bfloat16
    assert load_model("tiny-random").dit.autocast_dtype is None


def test_recipe_bf16_values():
    assert load_recipe("vae-tiny", [])["train"]["bf16"] == "auto"
    assert load_recipe("vae-tiny", ["train.bf16=false"])["train"]["bf16"] is False
    with pytest.raises(ConfigError, match="train.bf16"):
        load_recipe("vae-tiny", ['train.bf16="maybe"'])



def test_generation_threads_leave_the_decode_its_share(monkeypatch):
    """Causal with the decode on its own thread: all cores but one (measured on 2 cores: 1 thread
    rtf 2.20, 2 threads 1.24; hardware.generation_threads); prefix/interp with the split decode
    (two decode threads that inherit the number): half the cores; the decode inline, or the split
    forced off: every core; never fewer than one."""
    monkeypatch.delenv("AVATARSTREAM_SPLIT_DECODE", raising=False)
    g = hardware.generation_threads
    assert g("causal", True, cores=2) == 1 and g("causal", True, cores=8) == 7
    assert g("causal", True, cores=1) == 1
    assert g("causal", False, cores=2) == 2
    assert g("prefix", True, cores=2) == 1 and g("interp", True, cores=8) == 4
    assert g("prefix", True, cores=1) == 1 and g("prefix", False, cores=2) == 2
    assert hardware.split_decode("prefix", True) and not hardware.split_decode("causal", True)
    assert not hardware.split_decode("prefix", False) and not hardware.split_decode("prefix", True, live=True)
    monkeypatch.setenv("AVATARSTREAM_SPLIT_DECODE", "0")
    assert g("prefix", True, cores=2) == 2 and not hardware.split_decode("interp", True)
    monkeypatch.setenv("AVATARSTREAM_SPLIT_DECODE", "1")
    assert hardware.split_decode("causal", True) and not hardware.split_decode("causal", False)
    assert hardware.split_decode("prefix", True, live=True)


def test_parallel_history_pass_where_a_second_team_fits(monkeypatch):
    """The causal extra forward on a second thread where two teams of the generating thread's
    size fit in the cores (1 thread on 2 cores), forced either way by the environment."""
    monkeypatch.delenv("AVATARSTREAM_PARALLEL_HISTORY", raising=False)
    p = hardware.parallel_history_pass
    assert p(1, 2) and p(4, 8) and not p(2, 2) and not p(7, 8) and not p(1, 1)
    monkeypatch.setenv("AVATARSTREAM_PARALLEL_HISTORY", "0")
    assert not p(1, 2)
    monkeypatch.setenv("AVATARSTREAM_PARALLEL_HISTORY", "1")
    assert p(2, 2)
