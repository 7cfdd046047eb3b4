import math

import pytest
import torch

from asyncrl.algo.policy_loss import clipped_policy_loss
from asyncrl.algo.token_decomposition import TokenTable, bucket_masks, decompose

MAX_TOKENS = 100
# staleness, entropy, logprob, behaviour logprob, advantage, clip low/high/dual, response length,
# is_weight: ten tokens in staleness 0, 1 and 3-4 (2 and 5+ stay empty)
ROWS = [
    (0, 0.50, -0.20, -0.25, 1.0, 0, 0, 0, 10, 1.0),
    (0, 1.20, -1.50, -1.40, 1.0, 0, 1, 0, 10, 0.9),
    (0, 0.10, -0.05, -0.05, -0.5, 0, 0, 0, 25, 1.1),
    (0, 2.00, -2.30, -2.00, -0.5, 1, 0, 0, 25, 1.2),
    (1, 0.80, -0.70, -0.90, 0.5, 0, 0, 0, 26, 0.5),
    (1, 1.70, -3.00, -2.50, 0.5, 0, 0, 1, 50, 2.0),
    (1, 0.30, -0.40, -0.60, -1.5, 0, 0, 0, 75, 1.0),
    (3, 1.70, -1.10, -1.90, -1.5, 1, 0, 0, 76, 0.8),
    (4, 0.05, -0.01, -0.02, 2.0, 0, 1, 0, 100, 1.0),
    (3, 0.90, -0.90, -0.30, 2.0, 0, 0, 0, 100, 1.5),
]
# the buckets, read off the rows by hand: lengths 25 and 50 sit on an edge (<=, so the lower
# quarter); entropies 2.0 (token 3) then 1.7 twice, token 5 before token 7 (the earlier wins)
BUCKETS = {
    "stale_0": [0, 1, 2, 3], "stale_1": [4, 5, 6], "stale_2": [], "stale_3-4": [7, 8, 9], "stale_5+": [],
    "entropy_top20": [3, 5], "entropy_rest": [0, 1, 2, 4, 6, 7, 8, 9],
    "len_q1": [0, 1, 2, 3], "len_q2": [4, 5], "len_q3": [6], "len_q4": [7, 8, 9],
}


def _table(rows, dtype=torch.float64, with_weight=True):
    col = list(zip(*rows))
    real = lambda i: torch.tensor(col[i], dtype=dtype)  # noqa: E731
    flag = lambda i: torch.tensor(col[i], dtype=torch.bool)  # noqa: E731
    return TokenTable(
        staleness=torch.tensor(col[0], dtype=torch.int64), entropy=real(1), logprob=real(2),
        behaviour_logprob=real(3), advantage=real(4), clipped_low=flag(5), clipped_high=flag(6),
        clipped_dual=flag(7), response_length=torch.tensor(col[8], dtype=torch.int64),
        is_weight=real(9) if with_weight else None)


def _mean(xs):
    return sum(xs) / len(xs)


def _expected(rows, buckets):
    """Every metric from its definition, in plain Python floats."""
    n = len(rows)
    out = {}
    for name, idx in buckets.items():
        key = f"offpolicy/{name}"
        out[f"{key}/tokens"], out[f"{key}/frac"] = len(idx), len(idx) / n
        if not idx:
            continue
        sel = [rows[i] for i in idx]
        d = [r[2] - r[3] for r in sel]
        mean_logp, mean_adv = _mean([r[2] for r in sel]), _mean([r[4] for r in sel])
        out.update({
            f"{key}/entropy": _mean([r[1] for r in sel]),
            f"{key}/log_ratio": _mean(d),
            f"{key}/abs_log_ratio": _mean([abs(x) for x in d]),
            f"{key}/clip_low": _mean([float(r[5]) for r in sel]),
            f"{key}/clip_high": _mean([float(r[6]) for r in sel]),
            f"{key}/clip_dual": _mean([float(r[7]) for r in sel]),
            f"{key}/cov_logp_adv": sum((r[2] - mean_logp) * (r[4] - mean_adv) for r in sel) / len(sel),
            f"{key}/ratio_mean": _mean([math.exp(x) for x in d]),
            f"{key}/ratio_sq_mean": _mean([math.exp(2 * x) for x in d]),
        })
    fresh = [r[2] - r[3] for r in rows if r[0] == 0]
    out["offpolicy/mismatch_tokens"] = len(fresh)
    out["offpolicy/mismatch_abs"] = sum(abs(x) for x in fresh) / len(fresh)
    out["offpolicy/mismatch_k3"] = sum(math.exp(x) - x - 1.0 for x in fresh) / len(fresh)
    every = [r[2] - r[3] for r in rows]
    out["offpolicy/sampler_k3"] = sum(math.exp(x) - x - 1.0 for x in every) / n
    ratio = [math.exp(r[2] - r[3]) for r in rows]
    out["offpolicy/ess"] = sum(ratio) ** 2 / (n * sum(x * x for x in ratio))
    weight = [r[9] for r in rows]
    out["offpolicy/ess_is_weight"] = sum(weight) ** 2 / (n * sum(x * x for x in weight))
    return out


def _assert_same(got, want, tol=1e-12):
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=tol, rel=0), key


def test_every_metric_matches_its_definition():
    _assert_same(decompose(_table(ROWS), MAX_TOKENS), _expected(ROWS, BUCKETS))


def test_bucket_masks_are_the_hand_read_buckets():
    masks = bucket_masks(_table(ROWS), MAX_TOKENS)
    assert list(masks) == list(BUCKETS)
    assert {name: torch.nonzero(m).flatten().tolist() for name, m in masks.items()} == BUCKETS


def test_entropy_split_keeps_the_ceiling_of_the_fraction_and_is_named_by_it():
    # ceil(0.25 * 10) = 3: entropies 2.0, then the 1.7 tie at tokens 5 and 7
    masks = bucket_masks(_table(ROWS), MAX_TOKENS, top_entropy_frac=0.25)
    assert torch.nonzero(masks["entropy_top25"]).flatten().tolist() == [3, 5, 7]
    # 0.07 * 100 is 7.000000000000001 in floats; still 7 tokens, named top7
    rows = [(0, float(i), -1.0, -1.0, 0.0, 0, 0, 0, 1, 1.0) for i in range(100)]
    masks = bucket_masks(_table(rows), MAX_TOKENS, top_entropy_frac=0.07)
    assert torch.nonzero(masks["entropy_top7"]).flatten().tolist() == list(range(93, 100))


def test_concat_of_parts_gives_the_metrics_of_the_whole():
    g = torch.Generator().manual_seed(0)
    n = 300
    logprob = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    whole = TokenTable(
        staleness=torch.randint(0, 8, (n,), generator=g), entropy=torch.rand(n, generator=g, dtype=torch.float64),
        logprob=logprob, behaviour_logprob=logprob + 0.3 * torch.randn(n, generator=g, dtype=torch.float64),
        advantage=torch.randn(n, generator=g, dtype=torch.float64),
        clipped_low=torch.rand(n, generator=g) < 0.1, clipped_high=torch.rand(n, generator=g) < 0.1,
        clipped_dual=torch.rand(n, generator=g) < 0.05, response_length=torch.randint(1, 513, (n,), generator=g),
        is_weight=torch.rand(n, generator=g, dtype=torch.float64) * 2)
    cuts = [0, 37, 37, 150, 299, n]  # an empty part (a rank with no tokens) included
    parts = [TokenTable(**{k: v[a:b] for k, v in vars(whole).items()}) for a, b in zip(cuts, cuts[1:])]
    _assert_same(decompose(TokenTable.concat(parts), 512), decompose(whole, 512))
    rows = ROWS[:3], ROWS[3:7], ROWS[7:]
    _assert_same(decompose(TokenTable.concat([_table(r) for r in rows]), MAX_TOKENS), _expected(ROWS, BUCKETS))


def test_empty_buckets_report_only_count_and_frac_and_nothing_is_nan():
    got = decompose(_table(ROWS), MAX_TOKENS)
    for name in ("stale_2", "stale_5+"):
        assert [k for k in got if k.startswith(f"offpolicy/{name}/")] == [
            f"offpolicy/{name}/tokens", f"offpolicy/{name}/frac"]
        assert got[f"offpolicy/{name}/tokens"] == 0 and got[f"offpolicy/{name}/frac"] == 0.0
    assert all(math.isfinite(v) for v in got.values())
    # no staleness-0 token: no mismatch but its count; no token at all: counts only
    stale = decompose(_table([r for r in ROWS if r[0] > 0], with_weight=False), MAX_TOKENS)
    assert stale["offpolicy/mismatch_tokens"] == 0
    assert not {"offpolicy/mismatch_abs", "offpolicy/mismatch_k3", "offpolicy/ess_is_weight"} & set(stale)
    empty = decompose(TokenTable(**{k: v[:0] for k, v in vars(_table(ROWS)).items()}), MAX_TOKENS)
    counts = {f"offpolicy/{name}/{stat}" for name in BUCKETS for stat in ("tokens", "frac")}
    assert set(empty) == counts | {"offpolicy/mismatch_tokens"} and not any(empty.values())
    assert all(math.isfinite(v) for d in (stale, empty) for v in d.values())


def test_float32_inputs_are_computed_in_float64():
    table = _table(ROWS, dtype=torch.float32)
    # the reference takes the float32 values exactly, as Python floats; float32 arithmetic would
    # miss them by ~1e-7
    cols = [c.tolist() for c in (table.entropy, table.logprob, table.behaviour_logprob, table.advantage,
                                 table.is_weight)]
    rows = [(r[0], cols[0][i], cols[1][i], cols[2][i], cols[3][i], *r[5:9], cols[4][i]) for i, r in enumerate(ROWS)]
    assert rows != ROWS  # 0.2 etc. are not float32 numbers
    _assert_same(decompose(table, MAX_TOKENS), _expected(rows, BUCKETS))


def test_mismatch_k3_averages_to_the_engine_to_trainer_kl():
    # tokens a, a, b, c are pi_b = (1/2, 1/4, 1/4) exactly, as the engine samples them: the mean
    # of k3 over them is E_{pi_b}[k3] = KL(pi_b || pi_theta)
    behaviour, trainer = [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]
    rows = [(0, 1.0, math.log(trainer[a]), math.log(behaviour[a]), 0.0, 0, 0, 0, 1, 1.0) for a in (0, 0, 1, 2)]
    kl = sum(b * math.log(b / t) for b, t in zip(behaviour, trainer))
    assert decompose(_table(rows), MAX_TOKENS)["offpolicy/mismatch_k3"] == pytest.approx(kl, abs=1e-12, rel=0)


def test_ess_survives_a_huge_log_ratio():
    rows = [(0, 1.0, 0.0, -800.0, 0.0, 0, 0, 0, 1, 1e300), (0, 1.0, 0.0, 0.0, 0.0, 0, 0, 0, 1, 1.0)]
    got = decompose(_table(rows), MAX_TOKENS)
    assert got["offpolicy/ess"] == pytest.approx(0.5) and got["offpolicy/ess_is_weight"] == pytest.approx(0.5)
    # d = 800 is clamped to 20 before exp: r = e^20 and r^2 = e^40, not inf
    assert got["offpolicy/stale_0/ratio_mean"] == pytest.approx((math.exp(20) + 1) / 2, rel=1e-12)
    assert got["offpolicy/stale_0/ratio_sq_mean"] == pytest.approx((math.exp(40) + 1) / 2, rel=1e-12)


def test_ratio_moments_by_hand():
    # staleness 1: d = ln 2 and -ln 2, r = 2 and 1/2: mean 1.25, mean square (4 + 1/4) / 2 = 2.125;
    # staleness 0: d = 0, r = 1
    rows = [(1, 1.0, math.log(2.0), 0.0, 0.0, 0, 0, 0, 1, 1.0), (1, 1.0, 0.0, math.log(2.0), 0.0, 0, 0, 0, 1, 1.0),
            (0, 1.0, -1.0, -1.0, 0.0, 0, 0, 0, 1, 1.0)]
    got = decompose(_table(rows), MAX_TOKENS)
    assert got["offpolicy/stale_1/ratio_mean"] == pytest.approx(1.25, abs=1e-15)
    assert got["offpolicy/stale_1/ratio_sq_mean"] == pytest.approx(2.125, abs=1e-15)
    assert got["offpolicy/stale_0/ratio_mean"] == got["offpolicy/stale_0/ratio_sq_mean"] == 1.0


def test_from_policy_loss_takes_the_losss_flags_and_weights():
    logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    old, adv = torch.tensor([-1.5, -0.5, -1.0]), torch.tensor([1.0, -1.0, -1.0])
    _, diag = clipped_policy_loss(logp, old, adv, 0.2, 0.2)
    table = TokenTable.from_policy_loss(7, torch.tensor([7, 6, 3]), logp, torch.ones(3), old, adv, diag,
                                        torch.tensor([4, 4, 9]))
    assert table.staleness.tolist() == [0, 1, 4]
    assert table.clipped_high.tolist() == [True, False, False] and table.clipped_low.tolist() == [False, False, True]
    assert table.clipped_dual.tolist() == [False] * 3 and table.is_weight is None
    assert not table.logprob.requires_grad
    _, diag = clipped_policy_loss(logp, old, adv, 0.2, 0.2, proximal_logprobs=logp.detach() + 0.1)
    assert TokenTable.from_policy_loss(7, torch.tensor([7, 6, 3]), logp, torch.ones(3), old, adv, diag,
                                       torch.tensor([4, 4, 9])).is_weight is not None


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="negative staleness"):
        decompose(_table([(-1, *ROWS[0][1:])] + ROWS), MAX_TOKENS)
    with pytest.raises(ValueError, match="one \\[N\\] vector"):
        TokenTable(**{**vars(_table(ROWS)), "advantage": torch.zeros(3)})
    with pytest.raises(ValueError, match="is_weight"):
        TokenTable.concat([_table(ROWS), _table(ROWS, with_weight=False)])
    with pytest.raises(ValueError):
        decompose(_table(ROWS), MAX_TOKENS, top_entropy_frac=1.0)


def test_a_token_table_travels_as_one_float64_matrix_and_comes_back_exact():
    """learner/collectives.py gathers the ranks' tables as TokenTable.to_matrix() tensors."""
    n = 5
    g = torch.Generator().manual_seed(0)
    for weight in (None, torch.rand(n, generator=g)):
        table = TokenTable(staleness=torch.tensor([0, 1, 2, 3, 2**40]), entropy=torch.rand(n, generator=g),
                           logprob=-torch.rand(n, generator=g), behaviour_logprob=-torch.rand(n, generator=g),
                           advantage=torch.randn(n, generator=g), clipped_low=torch.tensor([1, 0, 0, 1, 0]).bool(),
                           clipped_high=torch.tensor([0, 1, 0, 0, 0]).bool(), clipped_dual=torch.zeros(n).bool(),
                           response_length=torch.tensor([7, 7, 9, 9, 1024]), is_weight=weight)
        m = table.to_matrix()
        assert m.dtype == torch.float64 and m.shape == (9 if weight is None else 10, n)
        back = TokenTable.from_matrix(m)
        for name in ("staleness", "response_length", "clipped_low", "clipped_high", "clipped_dual"):
            assert torch.equal(getattr(back, name), getattr(table, name)), name
        for name in ("entropy", "logprob", "behaviour_logprob", "advantage"):
            assert torch.equal(getattr(back, name), getattr(table, name).double()), name
        assert (back.is_weight is None) == (weight is None)
