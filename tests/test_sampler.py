"""Tests for photon.worker.sampler (CPU; one optional CUDA no-sync test)."""

from __future__ import annotations

import math

import pytest
import torch

from photon.core.sampling import derive_key
from photon.worker.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    gumbel_noise,
    noise_bits,
)

M32 = 0xFFFFFFFF


def make_batch(rows: int, device: str | torch.device = "cpu", **kw) -> SamplingBatch:
    """A batch with every feature off; keyword args override tensors, flags follow them."""
    f32 = {"dtype": torch.float32, "device": device}
    i64 = {"dtype": torch.int64, "device": device}
    t = {
        "temperature": torch.ones(rows, **f32),
        "top_k": torch.zeros(rows, dtype=torch.int32, device=device),
        "top_p": torch.ones(rows, **f32), "min_p": torch.zeros(rows, **f32),
        "keys": torch.arange(rows, **i64), "counters": torch.zeros(rows, **i64),
        "presence_penalty": torch.zeros(rows, **f32),
        "frequency_penalty": torch.zeros(rows, **f32),
        "repetition_penalty": torch.ones(rows, **f32),
        "ban_rows": torch.zeros(0, **i64), "ban_tokens": torch.zeros(0, **i64),
        "token_pool": None, "pool_rows": torch.arange(rows, **i64),
        "prompt_lens": torch.zeros(rows, **i64), "seq_lens": torch.zeros(rows, **i64),
    }
    max_logprobs = kw.pop("max_logprobs", -1)
    # Host flags come from the (CPU) keyword tensors, before they move to the device.
    flags = {
        "all_greedy": "temperature" in kw and bool((kw["temperature"] < 1e-5).all()),
        "any_top_k": "top_k" in kw and bool((kw["top_k"] > 0).any()),
        "any_top_p": "top_p" in kw and bool((kw["top_p"] < 1).any()),
        "any_min_p": "min_p" in kw and bool((kw["min_p"] > 0).any()),
        "any_penalties": kw.get("token_pool") is not None,
    }
    t.update({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    return SamplingBatch(**t, **flags, max_logprobs=max_logprobs)


def full(rows: int, value: float) -> torch.Tensor:
    return torch.full((rows,), value, dtype=torch.float32)


def tv_distance(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


# ----------------------------------------------------------------------------- greedy / seeds


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    out = Sampler()(logits, make_batch(6, temperature=full(6, 0.0)))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.topk_ids is None


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(4, 30)
    temp = torch.tensor([0.0, 1.0, 0.0, 1.0])
    out = Sampler()(logits, make_batch(4, temperature=temp))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_same_key_counter_same_token_regardless_of_batch():
    torch.manual_seed(0)
    target = torch.randn(1, 100)
    key, ctr = derive_key(1234), 7
    alone = Sampler()(target, make_batch(1, keys=torch.tensor([key]), counters=torch.tensor([ctr])))
    for pos, rows in [(0, 5), (3, 5), (8, 9)]:
        logits = torch.randn(rows, 100)
        logits[pos] = target[0]
        keys = torch.randint(0, 2**62, (rows,))
        ctrs = torch.randint(0, 100, (rows,))
        keys[pos], ctrs[pos] = key, ctr
        out = Sampler()(logits, make_batch(rows, keys=keys, counters=ctrs))
        assert out.token_ids[pos] == alone.token_ids[0]


def test_different_counters_and_keys_differ():
    logits = torch.zeros(200, 1000)  # uniform: a collision-heavy sampler would show here
    same_key = make_batch(200, keys=torch.full((200,), derive_key(5)),
                          counters=torch.arange(200))
    tokens = Sampler()(logits, same_key).token_ids
    assert tokens.unique().numel() > 150
    diff_key = make_batch(200, keys=torch.tensor([derive_key(5, i) for i in range(200)]))
    tokens = Sampler()(logits, diff_key).token_ids
    assert tokens.unique().numel() > 150


def test_derive_key_range_and_distinct():
    keys = {derive_key(s, c) for s in (-(2**63), -1, 0, 1, 2**62, 2**64 + 3) for c in range(4)}
    assert len(keys) == 24
    assert all(0 <= k < 2**62 for k in keys)
    assert derive_key(42, 1) == derive_key(42, 1) != derive_key(42, 0)


# ----------------------------------------------------------------------------- distribution


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature):
    n, base = 20000, torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    logits = base.expand(n, -1).contiguous()
    keys = torch.tensor([derive_key(s) for s in range(100)]).repeat_interleave(n // 100)
    batch = make_batch(n, keys=keys, counters=torch.arange(n) % 200,
                       temperature=full(n, temperature))
    tokens = Sampler()(logits, batch).token_ids
    assert tv_distance(tokens, torch.softmax(base / temperature, -1)) < 0.05


def test_gumbel_noise_statistics():
    noise = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert noise.shape == (64, 4096) and noise.dtype == torch.float32
    assert torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.05


# ----------------------------------------------------------------------------- filters


def test_top_k_only_returns_top_k():
    torch.manual_seed(1)
    n = 2000
    logits = torch.randn(1, 40).expand(n, -1).contiguous()
    batch = make_batch(n, top_k=torch.full((n,), 3, dtype=torch.int32), counters=torch.arange(n))
    tokens = Sampler()(logits, batch).token_ids
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) == allowed


def test_top_p_returns_only_nucleus():
    n = 2000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    logits = probs.log().expand(n, -1).contiguous()
    batch = make_batch(n, top_p=full(n, 0.75), counters=torch.arange(n))
    assert set(Sampler()(logits, batch).token_ids.tolist()) == {0, 1}  # 0.5 < 0.75 <= 0.8
    batch = make_batch(n, top_p=full(n, 0.1), counters=torch.arange(n))
    assert set(Sampler()(logits, batch).token_ids.tolist()) == {0}  # top token always kept


def test_top_k_and_top_p_per_row_and_off_rows():
    n = 3000
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(n, -1).contiguous()
    top_k = torch.tensor([2, 0, 0], dtype=torch.int32).repeat(n // 3)
    top_p = torch.tensor([1.0, 0.6, 1.0]).repeat(n // 3)
    batch = make_batch(n, top_k=top_k, top_p=top_p, counters=torch.arange(n))
    tokens = Sampler()(logits, batch).token_ids.view(-1, 3)
    assert set(tokens[:, 0].tolist()) == {0, 1}
    assert set(tokens[:, 1].tolist()) == {0, 1}
    assert set(tokens[:, 2].tolist()) == {0, 1, 2, 3}


def test_min_p_drops_unlikely_tokens():
    n = 2000
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = probs.log().expand(n, -1).contiguous()
    batch = make_batch(n, min_p=full(n, 0.45), counters=torch.arange(n))  # cut at 0.18
    assert set(Sampler()(logits, batch).token_ids.tolist()) == {0, 1, 2}


def test_bans_beat_argmax_for_greedy_and_random():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 100.0
    batch = make_batch(3, temperature=torch.tensor([0.0, 1.0, 0.0]),
                       ban_rows=torch.tensor([0, 1]), ban_tokens=torch.tensor([4, 4]))
    before = logits.clone()
    tokens = Sampler()(logits, batch).token_ids
    assert tokens[0] != 4 and tokens[1] != 4 and tokens[2] == 4
    assert torch.equal(logits, before)  # the caller's logits are not modified


# ----------------------------------------------------------------------------- penalties


def reference_penalties(logits, pool, rows, prompt_lens, seq_lens, pres, freq, rep):
    out = logits.clone()
    for r in range(logits.shape[0]):
        hist = pool[rows[r], : seq_lens[r]].tolist()
        output = hist[prompt_lens[r]:]
        for tok in set(hist):
            x = out[r, tok].item()
            out[r, tok] = x / rep[r] if x > 0 else x * rep[r]
        for tok in set(output):
            out[r, tok] -= freq[r] * output.count(tok) + pres[r]
    return out


def test_penalties_match_reference():
    torch.manual_seed(3)
    vocab, rows = 12, 4
    pool = torch.randint(0, vocab, (6, 9), dtype=torch.int32)
    pool[2, 7:] = -1  # garbage past seq_len must be ignored
    kw = {
        "token_pool": pool, "pool_rows": torch.tensor([2, 0, 5, 3]),
        "prompt_lens": torch.tensor([3, 0, 4, 2]), "seq_lens": torch.tensor([7, 5, 4, 9]),
        "presence_penalty": torch.tensor([0.5, -1.0, 2.0, 0.0]),
        "frequency_penalty": torch.tensor([0.3, 0.0, -0.7, 1.0]),
        "repetition_penalty": torch.tensor([1.3, 0.8, 1.0, 2.0]),
    }
    logits = torch.randn(rows, vocab) * 3
    got = apply_penalties(logits, make_batch(rows, **kw))
    want = reference_penalties(
        logits, pool, kw["pool_rows"].tolist(), kw["prompt_lens"].tolist(),
        kw["seq_lens"].tolist(), kw["presence_penalty"].tolist(),
        kw["frequency_penalty"].tolist(), kw["repetition_penalty"].tolist())
    assert torch.allclose(got, want, atol=1e-5)
    greedy = Sampler()(logits, make_batch(rows, temperature=full(rows, 0.0), **kw))
    assert torch.equal(greedy.token_ids, want.argmax(-1))


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_topk_matches():
    torch.manual_seed(4)
    logits = torch.randn(5, 64, dtype=torch.bfloat16)
    batch = make_batch(5, max_logprobs=3, min_p=full(5, 0.2),
                       ban_rows=torch.tensor([0]), ban_tokens=torch.tensor([7]))
    out = Sampler()(logits, batch)
    raw = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    want_lp, want_ids = raw.topk(3, dim=-1)
    assert torch.equal(out.topk_ids, want_ids) and torch.allclose(out.topk_logprobs, want_lp)
    zero = Sampler()(logits, make_batch(5, max_logprobs=0))
    assert zero.topk_ids.shape == (5, 0) and zero.logprobs.shape == (5,)


# ----------------------------------------------------------------------------- noise bits / sync


def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def py_noise_bits(key: int, counter: int, v: int) -> int:
    """Unbounded-int reference of noise_bits: defines the bits independent of any device."""
    key, counter = key & 0xFFFFFFFFFFFFFFFF, counter & 0xFFFFFFFFFFFFFFFF
    s = py_mix32((key >> 32) ^ 0x5BD1E995)
    s = py_mix32(s ^ (key & M32))
    s = py_mix32(s ^ (counter >> 32) ^ 0x1B873593)
    s = py_mix32(s ^ (counter & M32))
    return py_mix32(s ^ py_mix32(v ^ 0x68E31DA4))


def test_noise_bits_edge_keys_match_reference():
    keys = [0, 1, -1, -(2**63), 2**63 - 1, 2**62, -(2**62), derive_key(-5), -123456789]
    ctrs = [0, 1, 2**31, 2**32 + 5, -1, 7, 2**62, 0, 3]
    bits = noise_bits(torch.tensor(keys), torch.tensor(ctrs), 17)
    assert bits.min() >= 0 and bits.max() <= M32
    want = [[py_noise_bits(k, c, v) for v in range(17)] for k, c in zip(keys, ctrs, strict=True)]
    assert bits.tolist() == want
    assert torch.isfinite(gumbel_noise(torch.tensor(keys), torch.tensor(ctrs), 17)).all()


def full_feature_batch(rows: int, vocab: int, device: str) -> tuple[torch.Tensor, SamplingBatch]:
    logits = torch.randn(rows, vocab).to(device)
    batch = make_batch(
        rows, device, temperature=torch.tensor([0.0, 0.7, 1.0, 1.3]).repeat(rows // 4),
        top_k=torch.tensor([0, 5, 0, 50], dtype=torch.int32).repeat(rows // 4),
        top_p=torch.tensor([1.0, 0.9, 0.5, 1.0]).repeat(rows // 4),
        min_p=torch.tensor([0.0, 0.1, 0.0, 0.05]).repeat(rows // 4),
        token_pool=torch.randint(0, vocab, (rows, 16), dtype=torch.int32),
        seq_lens=torch.full((rows,), 12), prompt_lens=torch.full((rows,), 4),
        presence_penalty=full(rows, 0.5), frequency_penalty=full(rows, 0.2),
        repetition_penalty=full(rows, 1.1), counters=torch.arange(rows),
        ban_rows=torch.tensor([0, 1]), ban_tokens=torch.tensor([3, 9]), max_logprobs=4)
    return logits, batch


def test_meta_device_runs_without_data_dependence():
    """Meta tensors have no data: any .item()/nonzero()/mask-indexing would raise here."""
    logits, batch = full_feature_batch(8, 100, "meta")
    out = Sampler()(logits, batch)
    assert out.token_ids.shape == (8,) and out.token_ids.dtype == torch.int64
    assert out.topk_ids.shape == (8, 4) and out.topk_logprobs.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_sync_and_bits_match_cpu():
    logits, batch = full_feature_batch(64, 1000, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, batch)
        gpu_bits = noise_bits(batch.keys, batch.counters, 1000)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu_bits.cpu(), noise_bits(batch.keys.cpu(), batch.counters.cpu(), 1000))
    assert out.token_ids.shape == (64,) and out.topk_ids.shape == (64, 4)


def test_uniform_from_extreme_bits_gives_finite_gumbel_noise() -> None:
    """The largest hash (top bits all ones) once rounded u to exactly 1.0: +inf noise, and NaN
    on a masked (-inf) logit, which argmax picked past a grammar mask."""
    from photon.worker.sampler import uniform_from_bits

    bits = torch.tensor([0, 1, 2**31, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    u = uniform_from_bits(bits)
    assert (u > 0).all() and (u < 1).all()
    assert u[-1].item() == 1 - 2.0**-24 and u[0].item() == 2.0**-24
    noise = u.log().neg().log().neg()
    assert torch.isfinite(noise).all()
    masked = torch.tensor([float("-inf"), 0.0])
    assert int((masked + noise[[-1, 0]]).argmax()) == 1
