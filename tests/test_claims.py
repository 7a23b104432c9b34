"""The claim table and its checkers: every claim id once, every
checker present, and for each checker an input that agrees with the paper (-> reproduced), one
that contradicts it (-> not reproduced) and the not-run cases (seeds, convergence, scale).
Pure Python, no training."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deqbench.reproduce import checks as ck
from deqbench.reproduce.claims import CLAIMS, DIFFERS_FROM_OURS, PAPERS, claim, claims_of

IDS = [
    "001-klr-equivalence",
    "001-gp-informed-init",
    "001-denoise",
    "001-init-cost",
    "002-mnist-accuracy",
    "002-iterations",
    "002-lipschitz",
    "002-unconstrained",
    "003-residual-vs-k",
    "003-accuracy-vs-k",
    "003-unrolled-speed",
    "003-ift-memory",
    "004-pr-fb",
    "004-ntk-lambda-min",
    "004-trajectory-init",
    "004-trajectory-init-var",
    "004-trajectory-separation",
    "004-trajectory-separation-var",
    "004-landscape-repeats",
    "001-gp-naive-init",
    "001-klr-finetune",
    "001-hsi-denoise",
    "002-any-norm-convergence",
    "002-backward-iterations",
    "002-svhn-accuracy",
    "002-cifar10-accuracy",
    "003-ift-threshold",
    "003-unrolled-vs-ift-accuracy",
    "003-alpha",
    "004-trajectory-complexity",
    "004-trajectory-complexity-var",
]

R, NR, NRUN = "reproduced", "not reproduced", "not run"


# -- the table -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cid", IDS)
def test_every_required_claim_is_in_the_table_exactly_once(cid):
    assert [c.id for c in CLAIMS].count(cid) == 1


def test_claim_ids_are_unique():
    ids = [c.id for c in CLAIMS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("c", CLAIMS, ids=lambda c: c.id)
def test_every_claim_names_an_existing_checker_of_itself(c):
    fn = getattr(ck, c.check, None)
    assert callable(fn) and ck.CHECKERS[c.check] is fn
    assert ck.CLAIM_OF[c.check] == c.id


@pytest.mark.parametrize("c", CLAIMS, ids=lambda c: c.id)
def test_claim_rows_are_complete(c):
    assert c.id.startswith(c.paper + "-") and c.paper in PAPERS
    assert c.scale in ("trend", "absolute")
    assert c.where and c.claim and c.paper_value and c.data_note
    assert c.suite is None or (Path(__file__).parents[1] / "suites" / f"{c.suite}.yaml").exists()


def test_every_checker_belongs_to_a_claim():
    assert set(ck.CHECKERS) == {c.check for c in CLAIMS}


def test_the_clamp_check_is_not_a_claim():
    assert not any("nonneg" in c.claim.lower() or "clamp" in c.check for c in CLAIMS)


def test_only_table_numbers_are_absolute():
    assert [c.id for c in CLAIMS if c.scale == "absolute"] == [
        "001-hsi-denoise", "002-mnist-accuracy", "002-svhn-accuracy", "002-cifar10-accuracy"]  # fmt: skip


def test_claims_without_a_suite_say_what_is_missing():
    """A claim with no suite is listed all the same: its checker, called with the scale alone,
    is not run with a reason naming the missing data or suite (and the command for the data)."""
    none = [c for c in CLAIMS if c.suite is None]
    assert {c.id for c in none} == {"001-hsi-denoise", "002-svhn-accuracy",
                                    "002-cifar10-accuracy", "003-alpha"}  # fmt: skip
    for c in none:
        for scale in ("cpu", "paper"):
            v = ck.CHECKERS[c.check](scale=scale)
            assert v.verdict == NRUN, c.id
            assert v.reason.startswith(("data: ", "no suite: ")), (c.id, v.reason)
    assert "--data-root DIR" in ck.check_svhn_accuracy(scale="cpu").reason
    assert "--data-root DIR" in ck.check_cifar10_accuracy(scale="paper").reason
    assert ck.check_alpha(scale="cpu").reason == (
        "no suite: needs an alpha sweep of the deep OptEq (Table 5)")  # fmt: skip


@pytest.mark.parametrize("c", CLAIMS, ids=lambda c: c.id)
def test_every_claim_states_its_window_and_budget(c):
    assert c.window in ("init", "first_epoch", "training", "none")
    assert c.budget and c.thresholds
    if c.window in ("first_epoch", "training") and c.id != "004-ntk-lambda-min":
        assert c.paper_steps or c.paper_epochs, c.id


def test_differs_from_ours_covers_the_issue_findings():
    text = "\n".join(DIFFERS_FROM_OURS)
    for cid in (
        "001-init-cost",
        "002-lipschitz",
        "002-iterations",
        "003-accuracy-vs-k",
        "003-unrolled-speed",
        "004-landscape-repeats",
        "001-gp-informed-init",
    ):
        assert cid in text
    assert all(" -- " in line for line in DIFFERS_FROM_OURS)  # ours -- the paper's


def test_lookup_helpers():
    assert claim("003-accuracy-vs-k").paper == "003"
    assert {c.paper for c in claims_of("002")} == {"002"}
    assert len(claims_of()) == len(CLAIMS)
    with pytest.raises(KeyError):
        claim("999-nothing")


# -- verdict type and the trend rule -------------------------------------------------------------


def test_verdict_words_are_exactly_three():
    assert ck.VERDICTS == ("reproduced", "not reproduced", "not run")
    with pytest.raises(ValueError):
        ck.Verdict("x", "held", "", "", "")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ck.Verdict("x", "not run", "", "", "")


def test_verdict_carries_the_paper_value():
    v = ck.check_accuracy_vs_k(accuracy={5: [0.8, 0.81, 0.8], 40: [0.9, 0.9, 0.91]})
    assert v.claim_id == "003-accuracy-vs-k"
    assert v.paper_value == claim("003-accuracy-vs-k").paper_value
    assert "K=5" in v.measured and "K=40" in v.measured


def test_seed_trend_rule():
    assert ck.seed_trend([1.0, 1.1, 0.9]).holds
    assert not ck.seed_trend([1.0, 1.1]).holds  # < 3 seeds
    assert not ck.seed_trend([-1.0, -1.0, -1.0]).holds  # wrong direction
    # every seed agrees: small effects beside a large one still hold (no spread rule)
    assert ck.seed_trend([0.01, 0.02, 1.0]).holds
    assert not ck.seed_trend([0.5, 0.5, 0.5], min_effect=1.0).holds
    assert not ck.seed_trend([0.5, 1.5, 2.0], min_effect=1.0).holds  # one seed below the bar
    t = ck.seed_trend([1.0, math.nan, 1.2, 1.1])
    assert t.n == 3 and t.dropped == 1 and t.holds


# -- 001 -----------------------------------------------------------------------------------------


def test_klr_equivalence():
    f = ck.check_klr_equivalence
    base = dict(pixels=1000, converged=True, random_disagreeing=300)
    assert f(tie_distances=[], **base).verdict == R
    assert f(tie_distances=[3.8e-8, 1e-9], **base).verdict == R  # ties, as Table 2
    assert f(tie_distances=[0.1], **base).verdict == NR
    v = f(tie_distances=[], pixels=1000, converged=False)
    assert v.verdict == NRUN and v.reason.startswith("convergence")
    v = f(tie_distances=[], pixels=1000, converged=True, random_disagreeing=0)
    assert v.verdict == NRUN and v.reason.startswith("control")


GP_CONV = [1.0, 1.0, 0.99]


def test_gp_informed_init():
    f = ck.check_gp_informed_init
    good = f(
        informed={0: [0.3, 0.35, 0.32], 10: [0.15, 0.16, 0.17]},
        random={0: [1.0, 0.98, 0.97], 10: [0.4, 0.42, 0.41]},
        informed_converged=GP_CONV,
    )
    assert good.verdict == R
    bad = f(
        informed={0: [1.0, 0.98, 0.97], 10: [0.4, 0.42, 0.41]},
        random={0: [0.3, 0.35, 0.32], 10: [0.15, 0.16, 0.17]},
        informed_converged=GP_CONV,
    )
    assert bad.verdict == NR
    few = f(informed={0: [0.3, 0.3]}, random={0: [1.0, 1.0]}, informed_converged=[1.0, 1.0])
    assert few.verdict == NRUN and few.reason.startswith("seeds")
    # kglm_smooth's informed model at max_iter in every solve: never "reproduced"
    unconv = f(
        informed={0: [0.3, 0.35, 0.32]}, random={0: [1.0, 0.98, 0.97]}, informed_converged=[0, 0, 0]
    )
    assert unconv.verdict == NRUN and unconv.reason.startswith("convergence")


def test_denoise():
    f = ck.check_denoise
    kg = {0: [0.010, 0.011, 0.010], 2: [0.006, 0.0061, 0.0062]}
    rd = {0: [0.030, 0.031, 0.029], 2: [0.0075, 0.0076, 0.0074]}
    ok_failed = {"kglm": [0, 1, 0], "random": [3, 2, 4]}
    assert f(best_mse={"kglm": kg, "random": rd}, failed=ok_failed).verdict == R
    assert f(best_mse={"kglm": rd, "random": kg}, failed=ok_failed).verdict == NR
    more_failures = {"kglm": [5, 5, 5], "random": [0, 0, 0]}
    v = f(best_mse={"kglm": kg, "random": rd}, failed=more_failures)
    assert v.verdict == NR and "failed" in v.reason
    few = {"kglm": {0: [0.01]}, "random": {0: [0.03]}}
    assert f(best_mse=few, failed={}).verdict == NRUN
    unconv = f(
        best_mse={"kglm": kg, "random": rd},
        failed=ok_failed,
        converged={"kglm": [0.5, 0.6, 0.5], "random": [1, 1, 1]},
    )
    assert unconv.verdict == NRUN and unconv.reason.startswith("convergence")


def test_init_cost():
    f = ck.check_init_cost
    kg = {50: [1e-4, 1.1e-4, 1.2e-4], 850: [5e-3, 5.2e-3, 5.1e-3]}
    rd = {50: [3e-4, 3.1e-4, 3.2e-4], 850: [2e-2, 2.1e-2, 2.2e-2]}
    conv = {63: [0.3, 0.31, 0.32]}
    assert f(fc_kglm=kg, fc_random=rd, conv_kglm=conv).verdict == R
    # the issue's measurement: fc kGLM 19x slower than random
    v = f(fc_kglm=rd, fc_random=kg, conv_kglm=conv)
    assert v.verdict == NR and "fc" in v.reason
    v = f(fc_kglm=kg, fc_random=rd, conv_kglm={63: [2.0, 2.1, 2.0]})
    assert v.verdict == NR and "conv" in v.reason
    v = f(fc_kglm={50: [1e-4]}, fc_random={50: [3e-4]}, conv_kglm={63: [0.3]})
    assert v.verdict == NRUN and v.reason.startswith("seeds")


# -- 002 -----------------------------------------------------------------------------------------


def test_mnist_accuracy_absolute():
    f = ck.check_mnist_accuracy
    acc = {"pcDEQ-1-L-Tanh": [0.982, 0.983, 0.981], "pcDEQ-1-MC-ReLU6": [0.993, 0.994, 0.993]}
    v = f(accuracy=acc)  # default scale cpu
    assert v.verdict == NRUN and v.reason == "scale"
    v = f(accuracy=acc, scale="paper", paper_data=False)
    assert v.verdict == NRUN and v.reason.startswith("data")
    assert f(accuracy=acc, scale="paper", paper_data=True).verdict == R
    low = {"pcDEQ-1-L-Tanh": [0.96, 0.965, 0.962]}
    v = f(accuracy=low, scale="paper", paper_data=True)
    assert v.verdict == NR and "98.2" in v.measured
    v = f(accuracy={"pcDEQ-1-L-Tanh": [0.98]}, scale="paper", paper_data=True)
    assert v.verdict == NRUN and v.reason.startswith("seeds")
    with pytest.raises(ValueError):
        f(accuracy={"pcDEQ-9-XX": [0.9] * 3}, scale="paper", paper_data=True)


FLAT = [[4.0, 4.2, 4.1, 4.0, 4.1, 4.2, 4.0, 4.1]] * 3
GROWS = [
    [4.2, 6, 8, 10, 12, 14, 16, 18],
    [4.7, 6, 9, 11, 12, 15, 17, 18],
    [4.0, 5, 8, 9, 12, 13, 16, 17],
]


def test_iterations():
    f = ck.check_iterations
    acts = ("tanh", "softsign", "relu6", "sigmoid")
    v = f(forward_iterations={a: FLAT for a in acts})
    assert v.verdict == R and "sigmoid < 8 not compared" in v.reason
    # our earlier CPU measurement: relu6 4.2 -> 18
    v = f(forward_iterations={a: (GROWS if a == "relu6" else FLAT) for a in acts})
    assert v.verdict == NR and "relu6" in v.reason
    # a rise and fall is not flat: SC-relu6 of the paper-scale run, 9.2 -> 28.4 -> 17
    up_down = [[9.2, 28.4, 20.0, 17.0]] * 3
    v = f(forward_iterations={"SC:relu6": up_down, "SC:tanh": FLAT})
    assert v.verdict == NR and "SC:relu6" in v.reason and "SC:tanh" not in v.reason
    # every architecture is judged and shown
    v = f(forward_iterations={"L:tanh": FLAT, "SC:tanh": FLAT, "MC:tanh": GROWS})
    assert v.verdict == NR and "MC:tanh" in v.reason
    assert all(f"{a}:tanh first epoch" in v.measured for a in ("L", "SC", "MC"))
    assert f(forward_iterations={"tanh": FLAT[:2]}).verdict == NRUN
    # paper scale on MNIST: sigmoid must stay below 8
    high = [[9.0, 9.1, 9.0, 9.2]] * 3
    v = f(forward_iterations={"sigmoid": high}, scale="paper", paper_data=True)
    assert v.verdict == NR and "sigmoid" in v.reason
    v = f(forward_iterations={"sigmoid": FLAT}, scale="paper", paper_data=True)
    assert v.verdict == R
    # paper scale on stand-in data: the SC sigmoid peak shown in the reason, not judged
    v = f(forward_iterations={"sigmoid": high}, scale="paper", paper_data=False)
    assert v.verdict == R and "not compared on stand-in data (SC:sigmoid peak 9.2)" in v.reason
    v = f(forward_iterations={"L:sigmoid": FLAT}, scale="paper", paper_data=False)
    assert "no SC:sigmoid cell measured" in v.reason
    assert "below paper scale" in f(forward_iterations={"sigmoid": FLAT}).reason


def test_lipschitz():
    f = ck.check_lipschitz
    above = [[0.5, 1.2, 1.4, 1.5, 1.6]] * 3
    below = [[0.1, 0.3, 0.5, 0.6, 0.7]] * 3
    paper = {"tanh": above, "softsign": above, "sigmoid": above, "relu6": below}
    assert f(sigma_max=paper).verdict == R
    # the old check's expectation: below 1 for all four
    ours = {"tanh": below, "softsign": below, "sigmoid": below, "relu6": below}
    v = f(sigma_max=ours)
    assert v.verdict == NR and "tanh" in v.reason and "relu6" not in v.reason
    v = f(sigma_max={a: c[:1] for a, c in paper.items()})
    assert v.verdict == NRUN and v.reason.startswith("seeds")
    v = f(sigma_max={"tanh": above})
    assert v.verdict == NRUN and v.reason.startswith("data")


def test_seed_trend_a_larger_effect_cannot_flip_the_verdict():
    # the SC control of the committed paper-scale pcDEQ run: every seed's control grows more
    # than its pcDEQ (+10.3, +153.9, +6.6 iterations); the former rule (median > sd) said
    # "not reproduced" because the large seed inflated the spread to 84
    t = ck.seed_trend([10.3, 153.9, 6.6], min_effect=1.0)
    assert t.holds and t.agreeing == 3
    smaller = ck.seed_trend([10.3, 15.9, 6.6], min_effect=1.0)
    assert smaller.holds  # the same verdict with the large effect made small
    mixed = ck.seed_trend([10.3, -153.9, 6.6], min_effect=1.0)
    assert not mixed.holds and mixed.agreeing == 2
    two = ck.seed_trend([10.3, 153.9], min_effect=1.0)
    assert not two.holds and not two.enough_seeds


def test_unconstrained():
    f = ck.check_unconstrained
    assert f(pcdeq_iterations={"SC": FLAT}, control_iterations={"SC": GROWS}).verdict == R
    # the issue: at CPU scale the control converges as fast as the pcDEQ
    v = f(pcdeq_iterations={"SC": FLAT}, control_iterations={"SC": FLAT})
    assert v.verdict == NR and "SC" in v.reason
    two = f(pcdeq_iterations={"SC": FLAT[:2]}, control_iterations={"SC": GROWS[:2]})
    assert two.verdict == NRUN
    # every architecture the figure covers must hold; each one is shown
    v = f(pcdeq_iterations={"L": FLAT, "SC": FLAT, "MC": FLAT},
          control_iterations={"L": GROWS, "SC": GROWS, "MC": FLAT})  # fmt: skip
    assert v.verdict == NR and "MC" in v.reason and "L" not in v.reason.split(":")[-1]
    assert all(f"{a}: rise" in v.measured for a in ("L", "SC", "MC"))


def test_unconstrained_verdicts_through_the_rule():
    f = ck.check_unconstrained
    flat = [[6.0, 6.1, 6.0, 6.2]] * 3
    # per-seed control rises of +1.7x, +25x and +1.1x over flat pcDEQ curves: reproduced
    ctl = [[6.0, 16.3, 12.0], [6.0, 160.0, 100.0], [6.0, 12.6, 9.0]]
    assert f(pcdeq_iterations={"SC": flat}, control_iterations={"SC": ctl}).verdict == R
    # one seed's control falls instead: mixed sign -> not reproduced
    ctl_mixed = [ctl[0], [60.0, 30.0, 20.0], ctl[2]]
    v = f(pcdeq_iterations={"SC": flat}, control_iterations={"SC": ctl_mixed})
    assert v.verdict == NR


# -- 003 -----------------------------------------------------------------------------------------


def test_residual_vs_k():
    f = ck.check_residual_vs_k
    table8 = {5: [1.22e-2] * 3, 10: [4.88e-3] * 3, 20: [4.81e-4] * 3, 40: [1.20e-5] * 3}
    assert f(residual=table8).verdict == R
    flat = {5: [1e-2, 1.1e-2, 0.9e-2], 40: [1e-2, 0.9e-2, 1.1e-2]}
    assert f(residual=flat).verdict == NR
    floor = {5: [1e-2] * 3, 20: [5e-7] * 3, 40: [6e-7] * 3}  # K=20 -> 40 at float32 floor
    assert f(residual=floor).verdict == R
    assert f(residual={5: [1e-2], 40: [1e-5]}).verdict == NRUN


def test_accuracy_vs_k():
    f = ck.check_accuracy_vs_k
    t8 = {5: [0.835, 0.83, 0.84], 10: [0.873] * 3, 20: [0.877] * 3, 40: [0.878, 0.88, 0.875]}
    assert f(accuracy=t8).verdict == R
    # our earlier digits run: flat 0.957-0.965 -- within the seed spread
    flat = {5: [0.96, 0.957, 0.965], 40: [0.962, 0.958, 0.963]}
    assert f(accuracy=flat).verdict == NR
    assert f(accuracy={5: [0.8, 0.8], 40: [0.9, 0.9]}).verdict == NRUN


def test_unrolled_speed():
    f = ck.check_unrolled_speed
    v = f(
        unrolled={10: [2.2] * 3, 20: [3.9, 4.0, 3.8]},
        ift={1e-3: [16.3, 16, 16.5], 1e-2: [15.6] * 3},
    )
    assert v.verdict == R
    # the committed GPU run: IFT about 10x faster
    v = f(unrolled={20: [3.9, 4.0, 3.8]}, ift={1e-3: [0.4, 0.39, 0.41]})
    assert v.verdict == NR
    # faster, but far short of the paper's ratio (4.2x): 1.1x is not the paper's effect
    v = f(unrolled={20: [3.9] * 3}, ift={1e-3: [4.3] * 3})
    assert v.verdict == NR and "ratio" in v.reason
    # within the factor 2 of Table 8: 2.5x at K=20
    assert f(unrolled={20: [1.0] * 3}, ift={1e-3: [2.5] * 3}).verdict == R
    # CPU timings: not run whatever they say, the direction shown
    v = f(unrolled={20: [1.0] * 3}, ift={1e-3: [2.5] * 3}, device="cpu")
    assert v.verdict == NRUN and v.reason.startswith("scale: timed on cpu")
    assert v.direction == "with the paper"
    v = f(unrolled={40: [7.5] * 3}, ift={1e-3: [16.3] * 3})
    assert v.verdict == NRUN and v.reason.startswith("data")
    assert f(unrolled={20: [3.9]}, ift={1e-3: [16.3]}).verdict == NRUN


def test_ift_memory():
    f = ck.check_ift_memory
    mib = 2**20
    unr = {5: [10 * mib] * 3, 20: [40 * mib] * 3, 40: [80 * mib] * 3}
    assert f(unrolled=unr, ift={1e-3: [2 * mib] * 3, 1e-2: [2 * mib] * 3}).verdict == R
    assert f(unrolled=unr, ift={1e-3: [42 * mib] * 3}).verdict == NR
    # the committed CPU measurement: 3.05 MiB vs 4.29 MiB at K=20 is 71%, not "much less"
    v = f(unrolled={20: [4.29 * mib] * 3}, ift={1e-3: [3.05 * mib] * 3})
    assert v.verdict == NR and "0.5" in v.reason
    assert f(unrolled={20: [10 * mib]}, ift={1e-3: [2 * mib]}).verdict == NRUN
    v = f(unrolled={5: [10 * mib] * 3}, ift={1e-3: [2 * mib] * 3})
    assert v.verdict == NRUN and "K=20" in v.reason


# -- 004 -----------------------------------------------------------------------------------------


def _sweep(pr_ok=True, fb_below_ok=True, fb_above_ok=False):
    return ck.Sweep(
        bound=0.27,
        fb={1.0: fb_above_ok, 0.25: fb_below_ok, 0.125: fb_below_ok},
        pr={1.0: pr_ok, 0.5: pr_ok, 0.25: True},
    )


def test_pr_fb():
    f = ck.check_pr_fb
    assert f(sweeps=[_sweep()] * 3).verdict == R
    # FB converging above its bound does not contradict a sufficient condition
    assert f(sweeps=[_sweep(fb_above_ok=True)] * 3).verdict == R
    v = f(sweeps=[_sweep(), _sweep(pr_ok=False), _sweep()])  # one seed is enough to refute
    assert v.verdict == NR and "PR failed" in v.reason
    assert f(sweeps=[_sweep(fb_below_ok=False)] * 3).verdict == NR
    assert f(sweeps=[_sweep()] * 2).verdict == NRUN
    only_above = ck.Sweep(bound=0.1, fb={1.0: False}, pr={1.0: True})
    assert f(sweeps=[only_above] * 3).verdict == NRUN


def test_ntk_lambda_min():
    f = ck.check_ntk_lambda_min
    lam = [[0.07, 0.2, 0.5, 1.1], [0.06, 0.1, 0.4, 0.9], [0.08, 0.2, 0.6, 1.0]]
    ok = dict(log_loss_slope=[-0.02, -0.021, -0.019], converged=[True] * 3)
    assert f(lambda_min=lam, **ok).verdict == R
    collapse = [[0.07, 0.01, 0.001], [0.06, 0.005, 0.001], [0.08, 0.01, 0.002]]
    v = f(lambda_min=collapse, **ok)
    assert v.verdict == NR and "quarter" in v.reason
    v = f(lambda_min=lam, log_loss_slope=[0.01, 0.012, 0.011], converged=[True] * 3)
    assert v.verdict == NR and "linearly" in v.reason
    v = f(lambda_min=lam, predicted_slope=[-0.05, -0.05, -0.05], **ok)
    assert v.verdict == NR and "guarantee" in v.reason
    v = f(lambda_min=lam, log_loss_slope=[-0.02] * 3, converged=[True, False, True])
    assert v.verdict == NRUN and v.reason.startswith("convergence")
    assert f(lambda_min=lam[:2], log_loss_slope=[-0.02] * 2, converged=[True] * 2).verdict == NRUN
    # Condition 2 cannot hold for m > 1/sqrt(20): not run (conditions), the direction shown
    v = f(lambda_min=lam, margin=1.0, **ok)
    assert v.verdict == NRUN and v.reason.startswith("conditions") and v.direction
    assert f(lambda_min=lam, margin=0.2, **ok).verdict == R


def test_trajectory_init():
    f = ck.check_trajectory_init
    assert f(iterations={"small": [3, 4, 3], "standard": [100, 100, 90]}).verdict == R
    # both at the budget and no budget given: no effect, not reproduced
    assert f(iterations={"small": [100] * 3, "standard": [100] * 3}).verdict == NR
    assert f(iterations={"small": [3], "standard": [100]}).verdict == NRUN
    # both at the budget it states: censored, not run, with the residuals' direction
    at_budget = {"iterations": {"small": [100] * 3, "standard": [100] * 3}, "budget": [100] * 3}
    res = {"small": [0.006, 0.005, 0.007], "standard": [0.13, 0.12, 0.14]}
    v = f(**at_budget, residual=res)
    assert (v.verdict, v.direction) == (NRUN, "with the paper") and v.reason.startswith("censored")
    assert "small 0.006 vs standard 0.13" in v.measured and "f-evals to tol" in v.measured
    v = f(**at_budget, residual={"small": res["standard"], "standard": res["small"]})
    assert (v.verdict, v.direction) == (NRUN, "against the paper")
    assert f(**at_budget).verdict == NRUN  # no residuals: still censored
    # one init settles within the budget: the count orders them
    v = f(iterations={"small": [40, 100, 38], "standard": [100] * 3}, budget=[100] * 3)
    assert v.verdict == NR  # seed 1's small init used the whole budget: not faster there
    assert f(iterations={"small": [40, 39, 38], "standard": [100] * 3}, budget=[100] * 3,
             residual=res).verdict == R  # fmt: skip


def test_trajectory_separation():
    f = ck.check_trajectory_separation
    conv = [1.0, 0.98, 1.0]
    v = f(silhouette_init=[0.02, 0.03, 0.01], silhouette_trained=[0.3, 0.35, 0.32], converged=conv)
    assert v.verdict == R
    v = f(silhouette_init=[0.3, 0.35, 0.32], silhouette_trained=[0.02, 0.03, 0.01], converged=conv)
    assert v.verdict == NR
    v = f(silhouette_init=[0.02] * 3, silhouette_trained=[0.3] * 3, converged=[0.5, 0.6, 0.4])
    assert v.verdict == NRUN and v.reason.startswith("convergence")
    assert f(silhouette_init=[0.0], silhouette_trained=[0.3]).verdict == NRUN


def test_landscape_repeats():
    f = ck.check_landscape_repeats
    grows = {
        "repeat-6": [0.20, 0.21, 0.22],
        "repeat-11": [0.30, 0.31, 0.29],
        "repeat-18": [0.40, 0.41, 0.42],
        "deq": [0.50, 0.52, 0.51],
    }
    assert f(low_loss_area=grows, deq_converged=[1.0, 0.99, 0.97]).verdict == R
    shrinks = dict(zip(grows, reversed(list(grows.values()))))
    assert f(low_loss_area=shrinks, deq_converged=[1.0] * 3).verdict == NR
    # the committed comparison: DEQ converged at 86 of 2601 grid points
    v = f(low_loss_area=grows, deq_converged=[86 / 2601] * 3)
    assert v.verdict == NRUN and v.reason.startswith("convergence")
    v = f(low_loss_area={k: v[:1] for k, v in grows.items()}, deq_converged=[1.0])
    assert v.verdict == NRUN and v.reason.startswith("seeds")


# -- headline claims added with their own rows ---------------------------------------------------


def test_gp_naive_init():
    f = ck.check_gp_naive_init
    assert f(naive=[0.8, 0.85, 0.9], random=[1.1, 1.0, 1.2], naive_converged=GP_CONV).verdict == R
    # the committed paper-scale run: naive and random overlap at epoch 0 (mixed signs)
    v = f(naive=[1.089, 1.053, 1.10], random=[1.064, 1.099, 1.12], naive_converged=GP_CONV)
    assert v.verdict == NR and "naive" in v.reason
    v = f(naive=[0.8, 0.85, 0.9], random=[1.1, 1.0, 1.2], naive_converged=[0.0, 0.0, 0.0])
    assert v.verdict == NRUN and v.reason.startswith("convergence") and v.direction == ck.WITH_PAPER
    assert f(naive=[0.8, 0.8], random=[1.0, 1.0]).reason.startswith("seeds")
    # informed < naive is not the claim: no informed argument exists
    assert "informed" not in f(naive=[0.8] * 3, random=[1.0] * 3).measured


def test_klr_finetune():
    f = ck.check_klr_finetune
    assert f(kernel=[0.05, 0.06, 0.05], random=[0.09, 0.1, 0.08]).verdict == R
    assert f(kernel=[0.09, 0.1, 0.08], random=[0.05, 0.06, 0.05]).verdict == NR
    assert f(kernel=[0.05], random=[0.09]).verdict == NRUN
    v = f()
    assert v.verdict == NRUN and "kglm_klr_finetune" in v.reason
    # the test MSE rests on the forward solves: below the bar, not run, direction kept
    ok = {"kernel": [0.05, 0.06, 0.05], "random": [0.09, 0.1, 0.08]}
    assert f(**ok, converged=[1.0, 0.99, 1.0]).verdict == R
    v = f(**ok, converged=[1.0, 0.9, 1.0])
    assert (v.verdict, v.direction) == (NRUN, "with the paper") and "convergence" in v.reason


def test_hsi_denoise():
    f = ck.check_hsi_denoise
    table = {4: {5: {"kglm": [-6.64, -6.65, -6.63], "random": [-6.57, -6.58, -6.56]}}}
    assert f(log_loss=table, scale="paper", paper_data=True).verdict == R
    off = {4: {5: {"kglm": [-5.0, -5.1, -5.2], "random": [-6.57, -6.58, -6.56]}}}
    v = f(log_loss=off, scale="paper", paper_data=True)
    assert v.verdict == NR and "4 ch epoch 5 kglm" in v.reason
    assert f(log_loss=table, scale="cpu").reason == "scale"
    assert f(log_loss=table, scale="paper").reason.startswith("data")
    assert f().reason.startswith("data: ") and "road images" in f().reason


def test_table2_and_table3_accuracies():
    sv = {"pcDEQ-1-MC-ReLU6": [0.931, 0.929, 0.930]}
    assert ck.check_svhn_accuracy(accuracy=sv, scale="paper", paper_data=True).verdict == R
    low = {"pcDEQ-1-MC-ReLU6": [0.85, 0.86, 0.85]}
    v = ck.check_svhn_accuracy(accuracy=low, scale="paper", paper_data=True)
    assert v.verdict == NR and "below Table 2" in v.reason
    assert ck.check_svhn_accuracy(accuracy=sv, scale="cpu").reason == "scale"
    assert ck.check_svhn_accuracy(accuracy=sv, scale="paper").reason.startswith("data")
    cf = {"pcDEQ-1-MC-ReLU6*": [0.892, 0.893, 0.891]}
    assert ck.check_cifar10_accuracy(accuracy=cf, scale="paper", paper_data=True).verdict == R
    cf_low = {"pcDEQ-2-SC-Sigmoid": [0.70, 0.71, 0.70]}
    v = ck.check_cifar10_accuracy(accuracy=cf_low, scale="paper", paper_data=True)
    assert v.verdict == NR and "below Table 3" in v.reason
    with pytest.raises(ValueError):
        ck.check_svhn_accuracy(accuracy={"pcDEQ-1-L-Tanh": [0.9] * 3}, scale="paper",
                               paper_data=True)  # fmt: skip


def _epochs(sigmas: list[float], conv: float = 1.0, its: float = 8.0) -> list:
    return [ck.EpochSolves(s, conv, its) for s in sigmas]


def test_any_norm_convergence():
    f = ck.check_any_norm_convergence
    above = [_epochs([0.9, 1.2, 1.4, 1.6])] * 3
    # the committed paper-scale run: SC-softsign at sigma_max up to 1.62, every solve converged
    v = f(pcdeq={"SC:softsign": above, "L:relu6": [_epochs([0.5, 0.7])] * 3}, tol=1e-4)
    assert v.verdict == R and "SC:softsign: 9 epochs" in v.measured
    assert "implied c 0.316" in v.measured and "L:relu6" not in v.measured
    # one epoch above 1 that did not converge, in one seed: not reproduced
    broken = [above[0], above[1], _epochs([1.2, 1.3]) + [ck.EpochSolves(1.5, 0.5, 200.0)]]
    v = f(pcdeq={"SC:softsign": broken})
    assert v.verdict == NR and "SC:softsign" in v.reason
    # below 1 the theorem says nothing beyond Banach: unconverged epochs there do not count
    low = [_epochs([1.2, 1.3]) + [ck.EpochSolves(0.8, 0.0, 200.0)]] * 3
    assert f(pcdeq={"SC:tanh": low}).verdict == R
    # never above 1: not run, the case was not reached
    v = f(pcdeq={"L:relu6": [_epochs([0.5, 0.7])] * 3})
    assert v.verdict == NRUN and v.reason == "the case sigma_max > 1 was not reached"
    # above 1 in only two seeds
    v = f(pcdeq={"SC:tanh": [_epochs([1.2]), _epochs([1.1]), _epochs([0.9])]})
    assert v.verdict == NRUN and v.reason.startswith("seeds")
    # the control is shown, never judged
    ctl = {"SC:tanh": [_epochs([1.2, 1.3], conv=0.0, its=200.0)] * 3}
    v = f(pcdeq={"SC:softsign": above}, control=ctl)
    assert v.verdict == R and "SC:tanh 6 epochs above 1, worst converged 0%" in v.measured
    v = f(pcdeq={"SC:softsign": [_epochs([1.2, 1.3], conv=math.nan)] * 3})
    assert v.verdict == NRUN and v.reason.startswith("data")


def test_backward_iterations():
    f = ck.check_backward_iterations
    assert f(backward_iterations={"SC:tanh": FLAT, "L:sigmoid": FLAT}).verdict == R
    v = f(backward_iterations={"SC:tanh": FLAT, "L:relu6": GROWS})
    assert v.verdict == NR and "L:relu6" in v.reason and "SC:tanh" not in v.reason
    assert "sigmoid" not in f(backward_iterations={"SC:sigmoid": FLAT}).reason
    assert f(backward_iterations={"SC:tanh": FLAT[:2]}).verdict == NRUN
    assert f(backward_iterations={}).verdict == NRUN


def test_ift_threshold():
    f = ck.check_ift_threshold
    assert f(ift={1e-3: [0.876, 0.875, 0.877], 1e-2: [0.859, 0.86, 0.858]}).verdict == R
    assert f(ift={1e-3: [0.85, 0.86, 0.85], 1e-2: [0.87, 0.87, 0.88]}).verdict == NR
    assert f(ift={1e-3: [0.876] * 3}).verdict == NRUN
    assert f(ift={1e-3: [0.876], 1e-2: [0.859]}).verdict == NRUN


def test_unrolled_vs_ift_accuracy():
    f = ck.check_unrolled_vs_ift_accuracy
    table8 = dict(unrolled={20: [0.8771] * 3, 10: [0.8728] * 3},
                  ift={1e-3: [0.8763] * 3, 1e-2: [0.8595] * 3})  # fmt: skip
    assert f(**table8).verdict == R
    assert f(unrolled={20: [0.87] * 3}, ift={1e-3: [0.87] * 3}).verdict == R  # a tie: at least
    v = f(unrolled={20: [0.88, 0.86, 0.88], 10: [0.9] * 3}, ift={1e-3: [0.87] * 3, 1e-2: [0.8] * 3})
    assert v.verdict == NR and "K=20 vs thd 0.001" in v.reason and "K=10" not in v.reason
    assert f(unrolled={5: [0.8] * 3}, ift={1e-3: [0.87] * 3}).verdict == NRUN
    assert f(unrolled={20: [0.88] * 2}, ift={1e-3: [0.87] * 2}).verdict == NRUN


def test_alpha():
    f = ck.check_alpha
    table5 = {0.01: [0.584] * 3, 0.1: [0.568] * 3, 0.4: [0.869] * 3, 0.8: [0.874] * 3,
              1.0: [0.872] * 3}  # fmt: skip
    assert f(accuracy=table5).verdict == R
    flipped = {0.01: [0.87] * 3, 0.1: [0.88] * 3, 0.8: [0.6] * 3}
    assert f(accuracy=flipped).verdict == NR
    assert f(accuracy={0.8: [0.87] * 3, 1.0: [0.87] * 3}).reason.startswith("data")
    assert f(accuracy={0.1: [0.6] * 2, 0.8: [0.87] * 2}).reason.startswith("seeds")


@pytest.mark.parametrize("fn", ["check_trajectory_complexity", "check_trajectory_complexity_var"])
def test_trajectory_complexity(fn):
    f = getattr(ck, fn)
    assert f(iterations_first=[6, 7, 6], iterations_last=[20, 25, 18], last_epoch=40).verdict == R
    v = f(iterations_first=[20, 25, 18], iterations_last=[6, 7, 6], last_epoch=40)
    assert v.verdict == NR and "epoch 1 to 40" in v.reason
    assert f(iterations_first=[6, 7], iterations_last=[20, 25], last_epoch=40).verdict == NRUN
    v = f(iterations_first=[6, 7, 6], iterations_last=[6, 7, 6], last_epoch=1)
    assert v.verdict == NRUN and v.reason.startswith("data")


@pytest.mark.parametrize("fn", ["check_trajectory_complexity", "check_trajectory_complexity_var"])
def test_trajectory_complexity_censored_at_the_budget(fn):
    f = getattr(ck, fn)
    full = dict(iterations_first=[100] * 3, iterations_last=[100] * 3, last_epoch=40)
    budgets = dict(budget_first=[100] * 3, budget_last=[100] * 3)
    assert f(**full).verdict == NR  # no budget given: read as no rise
    # both recordings used the whole budget in every seed: censored, the residuals' direction
    res = dict(residual_first=[0.004, 0.005, 0.003], residual_last=[0.03, 0.02, 0.04])
    v = f(**full, **budgets, **res)
    assert (v.verdict, v.direction) == (NRUN, "with the paper") and v.reason.startswith("censored")
    assert "rel residual at the budget 0.004" in v.measured and "f-evals to tol" in v.measured
    flipped = dict(residual_first=res["residual_last"], residual_last=res["residual_first"])
    assert f(**full, **budgets, **flipped).direction == "against the paper"
    assert f(**full, **budgets).verdict == NRUN  # no residuals: still censored
    # epoch 1 settled within the budget: the count orders them (a lower bound on the last)
    v = f(iterations_first=[12, 14, 11], iterations_last=[100] * 3, last_epoch=40, **budgets)
    assert v.verdict == R
    v = f(iterations_first=[12, 100, 11], iterations_last=[100] * 3, last_epoch=40, **budgets,
          **res)  # fmt: skip
    assert v.verdict == NR  # seed 1 is at the budget twice, the others are not: not censored
