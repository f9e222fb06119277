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
    assert sw.best(8) is faster and sw.buckets[8].samples[not faster] >= 2 * (400 // 32) - 2


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


def test_a_sample_counts_at_most_clip_times_the_estimate():
    sw = SpeculationSwitch(alpha=1.0, clip=4.0)
    sw.observe(4, True, 40, 1.0)  # 10 tokens / s / request
    sw.observe(4, True, 40, 1000.0)  # an engine idle between requests
    assert sw.buckets[4].rate[True] == pytest.approx(2.5)
    sw.observe(4, True, 0, 0.0)  # no time: ignored
    assert sw.buckets[4].samples[True] == 2


@pytest.mark.parametrize("kw, field", [(dict(probe=1), "probe"), (dict(probe=4, explore_every=4), "explore_every")])
def test_refuses_bad_settings(kw, field):
    with pytest.raises(ValueError, match=field):
        SpeculationSwitch(**kw)
