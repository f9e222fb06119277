"""The speculation switch (``vllm_bole.spec_decode.switch``): trees or plain decoding per batch bucket,
driven as the runner drives it (a step runs in the mode decided one step earlier; only steady steps
are samples)."""
import pytest

from vllm_bole.spec_decode.switch import SpeculationSwitch


def drive(switch, rates, steps, batch=8, first_kind=False):
    """``steps`` engine steps of ``batch`` requests where a tree / plain step emits ``rates[mode]``
    tokens per request per second (1 s steps); returns the modes the steps ran in."""
    kind, ran = first_kind, []
    for _ in range(steps):
        decided = switch.decide(batch)
        if kind == decided:
            switch.observe(batch, kind, rates[kind] * batch, 1.0)
        ran.append(kind)
        kind = decided
    return ran


@pytest.mark.parametrize("faster", [True, False])
def test_keeps_the_faster_mode_and_probes_the_other(faster):
    sw = SpeculationSwitch(probe=3, explore_every=32)
    ran = drive(sw, {faster: 2.0, not faster: 1.0}, 400)
    late = ran[100:]
    slower = sum(k != faster for k in late)
    # one probe of `probe` steps per `explore_every` steps (+1: a switch back runs one step late)
    assert 0 < slower <= (len(late) // 32 + 1) * 4, slower
    assert sw.best(8) is faster and sw.rates(8) == {faster: 2.0, not faster: 1.0}


def test_first_probes_are_not_followed_by_another_at_once():
    """After each mode's first probe the slower one waits ``explore_every`` steps for its next."""
    sw = SpeculationSwitch(probe=3, explore_every=32)
    ran = drive(sw, {True: 1.0, False: 2.0}, 40)
    assert ran[:8] == [False, True, True, True, False, False, False, False]  # the first step ran before any choice
    assert not any(ran[8:36]), ran


def test_follows_a_change_of_rates():
    sw = SpeculationSwitch(probe=3, explore_every=16)
    drive(sw, {True: 2.0, False: 1.0}, 100)
    assert sw.best(8) is True
    ran = drive(sw, {True: 0.5, False: 1.0}, 200, first_kind=True)
    assert sw.best(8) is False and sum(ran[-64:]) <= 4 * 4 + 1


def test_buckets_are_independent():
    sw = SpeculationSwitch(probe=2, explore_every=64)
    drive(sw, {True: 3.0, False: 1.0}, 50, batch=1)
    drive(sw, {True: 1.0, False: 3.0}, 50, batch=30)
    assert sw.best(1) is True and sw.best(30) is False and sw.best(17) is False
    assert sorted(sw.buckets) == [1, 32]


def test_outliers_do_not_move_the_estimate():
    """Tokens over seconds of the last samples, without steps over ``OUTLIER`` times the median step
    time: a step that compiled kernels (1000x slower) changes nothing; ``window`` new samples replace
    the old rate."""
    sw = SpeculationSwitch(window=5)
    for s in (1.0, 1.0, 1000.0, 1.0, 1.0):
        sw.observe(4, True, 40, s)  # 10 tokens / s / request, one step 1000x slower
    assert sw.rates(4) == {True: 10.0}
    for _ in range(5):
        sw.observe(4, True, 80, 1.0)
    assert sw.rates(4) == {True: 20.0} and sw.samples(4) == {True: [[20.0, 1.0]] * 5}
    sw.observe(4, True, 0, 0.0)  # no time: ignored
    assert len(sw.buckets[4].samples[True]) == 5


def test_noisy_tree_steps_keep_trees_when_they_are_faster():
    """Tree steps emit 1-9 tokens (mean 3.9, 8.9 ms a step: 441 tokens / s) against plain decoding's
    1 token in 3.5 ms (286 / s), the H200's one-request MT-Bench case at 59e0ecd: trees must run most
    steps. The median of 5 per-step rates ran them 9% of the steps (a few short steps sent the switch
    plain for ``explore_every`` steps)."""
    import random

    sw, rng, kind, ran, tokens, seconds = SpeculationSwitch(), random.Random(0), True, [], 0, 0.0
    for _ in range(2000):
        decided = sw.decide(1)
        tok, sec = (rng.choices(range(1, 10), [20, 15, 15, 12, 10, 10, 8, 6, 4])[0], 0.0089) if kind else (1, 0.0035)
        tokens, seconds = tokens + tok, seconds + sec
        if kind == decided:
            sw.observe(1, kind, tok, sec)
        ran.append(kind)
        kind = decided
    assert sum(ran) / len(ran) > 0.8 and tokens / seconds > 400, (sum(ran), tokens / seconds)


@pytest.mark.parametrize("kw, field", [(dict(probe=1), "probe"), (dict(probe=4, explore_every=4), "explore_every"),
                                       (dict(window=0), "window")])
def test_refuses_bad_settings(kw, field):
    with pytest.raises(ValueError, match=field):
        SpeculationSwitch(**kw)
