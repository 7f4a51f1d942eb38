"""Intervals of fidelity figures: Wilson on known binomial cases, the bootstrap's determinism,
coverage and edge shapes, and the verdict against a floor."""

import math

import numpy as np
import pytest

from questprof.fidelity.stats import recall_interval, verdict, wilson


@pytest.mark.parametrize("k,n,lo,hi", [
    (3, 5, 0.23072, 0.88236),    # Wilson (1927); Newcombe (1998) table I, method 3
    (0, 20, 0.0, 0.16113),       # the "rule of three" case: upper 0.161, not 3/20 = 0.15
    (20, 20, 0.83887, 1.0),
    (81, 263, 0.25529, 0.36621),  # Newcombe (1998): 0.2553, 0.3662
    (1, 1, 0.20654, 1.0),
])
def test_wilson_known_values(k, n, lo, hi):
    got = wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def test_wilson_of_no_sample_is_nan():
    assert all(math.isnan(x) for x in wilson(0, 0))


def _values(rng, prompts=7, steps=5, heads=23):
    """Recall per (prompt, step, head): a head effect plus prompt and step noise, in (0, 1)."""
    head = rng.uniform(0.8, 0.99, heads)
    prompt = rng.normal(0, 0.02, (prompts, 1, 1))
    noise = rng.normal(0, 0.02, (prompts, steps, heads))
    return np.clip(head + prompt + noise, 0, 1)


def test_bootstrap_is_deterministic_and_brackets_its_estimates():
    values = _values(np.random.default_rng(3))
    a, b = recall_interval(values, 300, seed=5), recall_interval(values, 300, seed=5)
    assert a == b
    assert a.mean == pytest.approx(values.mean())
    assert a.p10 == pytest.approx(np.percentile(values.mean(axis=(0, 1)), 10))
    assert a.mean_lo <= a.mean <= a.mean_hi and a.p10_lo <= a.p10 <= a.p10_hi
    assert a.mean_hi - a.mean_lo > 0
    other = recall_interval(values, 300, seed=6)
    assert other.mean == a.mean and (other.mean_lo, other.mean_hi) != (a.mean_lo, a.mean_hi)


def test_bootstrap_interval_covers_the_true_mean_about_95_percent():
    """60 seeded samples from one population: the mean's interval holds the true mean in
    most of them (a percentile bootstrap of 7 prompts runs a little short of 95%)."""
    rng = np.random.default_rng(11)
    head = rng.uniform(0.8, 0.99, 23)
    covered = 0
    for trial in range(60):
        noise = rng.normal(0, 0.03, (7, 1, 1)) + rng.normal(0, 0.02, (7, 5, 23))
        got = recall_interval(head + noise, 200, seed=trial)
        covered += got.mean_lo <= head.mean() <= got.mean_hi
    assert covered >= 48, covered


def test_more_prompts_give_a_narrower_interval():
    rng = np.random.default_rng(2)
    few, many = recall_interval(_values(rng, prompts=3), 300), recall_interval(
        _values(rng, prompts=40), 300)
    assert many.mean_hi - many.mean_lo < few.mean_hi - few.mean_lo


def test_one_prompt_one_step_and_nan_values():
    rng = np.random.default_rng(4)
    single = recall_interval(_values(rng, prompts=1, steps=1), 50)
    assert single.mean_lo == pytest.approx(single.mean) == pytest.approx(single.mean_hi)
    values = _values(rng)
    values[0, 0, :5] = np.nan
    got = recall_interval(values, 100)
    assert np.isfinite([got.mean, got.mean_lo, got.mean_hi, got.p10_lo, got.p10_hi]).all()
    empty = recall_interval(np.full((2, 2, 3), np.nan), 100)
    assert math.isnan(empty.mean) and empty.resamples == 0


def test_columns_round_and_name_the_bootstrap():
    got = recall_interval(_values(np.random.default_rng(5)), 100, seed=9).columns()
    assert set(got) == {"mass_recall_lo", "mass_recall_hi", "mass_recall_p10_lo",
                        "mass_recall_p10_hi", "bootstrap", "bootstrap_seed"}
    assert got["bootstrap"] == 100 and got["bootstrap_seed"] == 9


@pytest.mark.parametrize("lo,hi,expected", [
    (0.91, 0.95, "passes"), (0.90, 0.95, "passes"), (0.85, 0.89, "fails"),
    (0.88, 0.92, "not decided"), (None, None, "no interval"), (float("nan"), 0.9, "no interval"),
])
def test_verdict_against_the_floor(lo, hi, expected):
    assert verdict(lo, hi, 0.9) == expected
