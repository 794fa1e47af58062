"""The benchmarks' shared accounting (experiments/_bench.py) on synthetic kernel timelines."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))

from _bench import HOST_GAP_US, critical_path, place_spread, round_orders  # noqa: E402


def test_critical_path_charges_gaps_and_exposed_time():
    # a [0, 10]; b launched early (PDL) at 2, ends 15: exposed 5; c after a 1 us launch gap, ends 20;
    # the host's pause; d [200, 205]; e inside d: nothing exposed
    ev = [(0, 10, "a"), (2, 13, "b"), (16, 4, "c"), (200, 5, "d"), (201, 2, "e")]
    got = critical_path(ev)
    assert got == {"a": [10, 1, 10, 0], "b": [13, 1, 5, 0], "c": [4, 1, 4, 1], "d": [5, 1, 5, 0], "e": [2, 1, 0, 0]}
    # a chain's gaps + exposed times are its span, in any input order
    chain = [(0, 3, "x"), (3.5, 2, "y"), (4, 5, "z"), (9.5, 1, "y")]
    tot = critical_path(reversed(chain))
    assert sum(v[2] + v[3] for v in tot.values()) == 10.5
    # negative control: charging each kernel its whole duration (no overlap accounting) overcounts
    assert sum(v[0] for v in tot.values()) == 11


def test_host_pauses_are_not_launch_gaps():
    got = critical_path([(0, 1, "a"), (1 + HOST_GAP_US, 1, "b"), (2 + HOST_GAP_US + 0.5, 1, "b")])
    assert got["b"][3] == 0.5 and got["b"][2] == 2


def test_sass_loop_picks_the_backward_branch_with_the_most_mmas():
    """``experiments/sass_loop.py``'s loop finder: of two backward branches it takes the body with the
    MMAs, ignores forward branches, and counts predicated instructions by opcode; a listing without a
    backward branch has no loop (negative side)."""
    from sass_loop import hot_loop, opcode_mix

    def ins(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;   /* 0x0 */"

    sass = "\n".join([
        ins(0x00, "MOV R1, c[0x0][0x28]"),
        ins(0x10, "IADD3 R2, R2, 0x1, RZ"),
        ins(0x20, "@!P0 BRA 0x10"),                    # a loop without MMAs
        ins(0x30, "LDS.64 R4, [R3]"),
        ins(0x40, "HMMA.16816.F32 R8, R4, R6, R8"),
        ins(0x50, "@P1 BRA 0x80"),                     # forward: not a loop
        ins(0x60, "HMMA.16816.F32 R8, R4, R6, R8"),
        ins(0x70, "@!P2 BRA 0x30"),                    # the MMA loop
        ins(0x80, "EXIT"),
    ])
    body = hot_loop(sass)
    assert len(body) == 5 and body[0].startswith("LDS.64") and body[-1].startswith("@!P2 BRA")
    mix = opcode_mix(body)
    assert mix["HMMA.16816.F32"] == 2 and mix["BRA"] == 2 and mix["LDS.64"] == 1
    assert hot_loop("\n".join([ins(0x00, "HMMA.16816.F32 R8, R4, R6, R8"), ins(0x10, "BRA 0x20")])) == []


def test_carveouts_refuse_when_no_kernel_was_recorded(monkeypatch):
    """The carveout variants must not run without carveout_hook: with no kernel recorded the
    carveouts would reach none (session 27's moe_gu_st3_cv* step variants did exactly that). An
    empty spec needs no hook; negative control: with a kernel recorded, the carveout is set (here a
    stand-in for the driver call) and reset to the driver's default afterwards."""
    import pytest

    import _bench

    monkeypatch.setattr(_bench, "_FUNCS", {})
    with pytest.raises(RuntimeError, match="carveout_hook"):
        with _bench.carveouts([(None, 57)]):
            pass
    with _bench.carveouts([]):
        pass
    calls = []
    monkeypatch.setattr(_bench, "_FUNCS", {"_moe_gate_up_kernel": {1}})
    monkeypatch.setattr(_bench, "set_carveout", lambda pct, names=None: calls.append((pct, names)) or 1)
    with _bench.carveouts([(["_moe_gate_up_kernel"], 57)]):
        assert calls == [(57, ["_moe_gate_up_kernel"])]
    assert calls[-1] == (-1, None)   # back at the driver's default afterwards


def test_sweep_takes_the_ab_variants_but_not_the_ablations():
    """bench_step.py --sweep-variants: the --ab variants (default_again, the A/A control, among them),
    not the ablations (they replay a routing recorded at one context) nor unknown names; --contexts ''
    is no context at all."""
    import types

    import bench_step

    bench_step.check_sweep_variants(["default", "default_again", "attn_ns66", "attn_kv_first2_pf2"])
    with pytest.raises(ValueError, match="ablations are not swept"):
        bench_step.check_sweep_variants(["attn_ns66", "ceil_router"])
    with pytest.raises(ValueError, match="'attn_ns67' is not an --ab variant"):
        bench_step.check_sweep_variants(["attn_ns67"])
    rnd = types.SimpleNamespace(model="m")
    bench_step.AB_VARIANTS["default_again"](rnd)
    assert vars(rnd) == {"model": "m"}
    shared = types.SimpleNamespace(_attn_options={"variant": "v2"})
    ns66 = types.SimpleNamespace(model=shared)
    bench_step.AB_VARIANTS["attn_ns66"](ns66)
    assert ns66.model._attn_options == {"variant": "v2", "num_splits": 66}
    assert shared._attn_options == {"variant": "v2"}   # a copy of the model changed, not the shared one
    assert bench_step._ints("") == () and bench_step._ints("8192,65536") == (8192, 65536)


def test_changes_run_under_an_ablation_whatever_the_order():
    """bench_step.apply_variants: a change (attn_ns66) and an ablation (ceil_router) together, given in
    either order, give a pass that is ablated and runs the change (the stub's layers return the attention
    options they would call the kernels with). Negative control: the change applied after the ablation,
    the order that until session 35 silently ran the default's options, is refused."""
    import types

    import bench_step

    class Stub:
        def __init__(self):
            self.shard = types.SimpleNamespace(num_heads=6, num_kv_heads=1)
            self.cfg = types.SimpleNamespace(head_dim=128, hidden_size=768)
            self._attn_options, self._proj = {}, None

        def _layers_fast(self, *args, **kw):
            return dict(self._attn_options)

    for order in (("ceil_router", "attn_ns66"), ("attn_ns66", "ceil_router"), ("default", "attn_ns66")):
        rnd = types.SimpleNamespace(model=Stub())
        bench_step.apply_variants(rnd, *order)
        assert rnd.model._layers_fast() == {"num_splits": 66}
        assert getattr(rnd.model, "_ablated", ()) == (("router",) if "ceil_router" in order else ())
    rnd = types.SimpleNamespace(model=Stub())
    bench_step.ab_variant("ceil_router")(rnd)
    with pytest.raises(ValueError, match="would not run"):
        bench_step.ab_variant("attn_ns66")(rnd)


def test_a_variant_reaches_the_rounds_hooks():
    """bench_step's model variants rebind Round's hooks (sampler, uniforms, draft update, settle): they are
    bound to the model at construction, so a variant read only there (sampler_max's options, torch_glue's
    settle and draft update) timed the default until session 36. A hook a variant replaced (torch_uniforms)
    stays replaced; the first model is left as it was (the negative control: its hooks still give the
    default's answers, which is what the unbound Round ran)."""
    import types

    import bench_step
    from runtime import rng

    class Stub:
        def __init__(self):
            self._sampler_options, self.fused_glue = {}, True

        def sample_rows(self, *a):
            return dict(self._sampler_options)

        def take_draft(self, *a):
            return dict(self._sampler_options) if self.fused_glue else False

        def settle(self, *a):
            return self.fused_glue

        def uniform(self, *a):
            return "kernel"

    def round_of(m):
        return types.SimpleNamespace(model=m, _sample_rows=m.sample_rows, _uniform=m.uniform,
                                     _take_draft_hook=m.take_draft, _settle_hook=m.settle)

    first = Stub()
    rnd = round_of(first)
    bench_step.apply_variants(rnd, "torch_uniforms", "sampler_max")
    assert rnd._sample_rows() == {"select": "max"} and rnd._take_draft_hook() == {"select": "max"}
    assert rnd._uniform is rng.uniform                # replaced by torch_uniforms, not rebound
    assert first.sample_rows() == {} and first._sampler_options == {}   # the default, untouched
    rnd = round_of(Stub())
    bench_step.apply_variants(rnd, "torch_glue")
    assert rnd._settle_hook() is False and rnd._take_draft_hook() is False
    rnd._take_draft_hook = None                       # torch_draft_update's change survives a later variant
    bench_step.apply_variants(rnd, "sampler_max")
    assert rnd._take_draft_hook is None and rnd._sample_rows() == {"select": "max"}


def test_every_runtime_kernel_has_a_profile_part():
    """bench_step.py --profile files each kernel under a part of the step by its name. Every Triton
    kernel defined under runtime/ must land in a named part, not "other" (the folded router did, from
    session 44 to 47, and its time was missing from the router's row). Negative control: a name no
    pattern knows is "other"."""
    import pathlib
    import re

    import bench_step

    root = pathlib.Path(__file__).resolve().parents[1] / "runtime"
    names = sorted({m for f in root.rglob("*.py") for m in re.findall(r"^def (_\w+_kernel)\(", f.read_text(), re.M)})
    assert "_route_folded_kernel" in names and len(names) >= 20
    unfiled = [n for n in names if bench_step.kernel_part(n) == "other"]
    assert unfiled == []
    assert bench_step.kernel_part("_route_folded_kernel") == "router"
    assert bench_step.kernel_part("_brand_new_kernel") == "other"


def test_calibration_plan_alternates_scenarios_and_numbers_from_start():
    """``experiments/replay_calibration.py``: the scenarios alternate, so a run cut short by ``budget_s``
    holds each of them; ``start`` numbers the datasets (their seeds), so batches from two machines merge
    without two datasets sharing a seed."""
    import replay_calibration as rc
    s = dict(rc.DEFAULTS, n_aa=3, n_slow=2, n_policy=1, start=0)
    assert rc.interleave(s) == [("aa", 0), ("slow", 0), ("policy", 0), ("aa", 1), ("slow", 1), ("aa", 2)]
    later = rc.interleave(dict(s, start=10))
    assert [i for _, i in later] == [10, 10, 10, 11, 11, 12]
    assert not {(c, i) for c, i in rc.interleave(s)} & {(c, i) for c, i in later}
    assert rc.interleave(dict(s, n_aa=0, n_slow=0, n_policy=0)) == []


def test_calibration_null_intervals_read_the_width_against_the_scatter():
    """Every interval whose truth is 0 (each run's A/A arm, the aa runs' candidate) counts; intervals as wide
    as the estimates' scatter read z_rms ~ 1 and hold 0 ~95 % of the time; the negative control, the same
    estimates with intervals half as wide, reads z_rms ~ 2 and holds 0 far less often."""
    import numpy as np
    import pandas as pd
    import replay_calibration as rc
    rng = np.random.default_rng(0)
    n, se = 400, 0.002
    est = rng.normal(0.0, se, size=(n, 2))
    slow = np.arange(n) % 2 == 1

    def frame(width):
        half = 1.959963984540054 * se * width
        return pd.DataFrame({"scenario": np.where(slow, "slow", "aa"),
                             "aa_mean_log": est[:, 0], "aa_lo": est[:, 0] - half, "aa_hi": est[:, 0] + half,
                             "mean_log": est[:, 1], "ci_lo": est[:, 1] - half, "ci_hi": est[:, 1] + half})
    good, narrow = rc.null_intervals(frame(1.0)), rc.null_intervals(frame(0.5))
    assert good["n"] == narrow["n"] == n + n // 2       # the slow runs' candidates are not null intervals
    assert 0.9 <= good["holding"] <= 0.99 and 0.9 <= good["z_rms"] <= 1.1, good
    assert narrow["holding"] < 0.8 and narrow["z_rms"] > 1.8, narrow


def test_calibration_plot_counts_the_intervals_that_miss_their_truth(tmp_path):
    """Each run draws its candidate's interval against its truth and its A/A arm's against 0; the misses are
    counted (and drawn red). Control: the same runs with the slow run's truth moved outside its interval."""
    import math

    import pandas as pd
    import replay_calibration as rc
    df = pd.DataFrame({"scenario": ["aa", "slow"], "dataset": [0, 1], "truth_log": [0.0, math.log1p(0.01)],
                       "mean_log": [-0.004, 0.011], "ci_lo": [-0.009, 0.008], "ci_hi": [-0.001, 0.014],
                       "aa_mean_log": [0.001, 0.003], "aa_lo": [-0.002, 0.0001], "aa_hi": [0.004, 0.006]})
    assert rc.plot_intervals(df, tmp_path / "a.png") == 2          # aa#0's candidate, slow#1's A/A arm
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    moved = df.assign(truth_log=[0.0, math.log1p(0.02)])
    assert rc.plot_intervals(moved, tmp_path / "b.png") == 3


def test_calibration_pooled_offsets_find_an_offset_one_kind_carries():
    """Per kind of null interval, the offset beyond the request noise pooled over runs: ~0 where the
    estimates scatter as their intervals say (the A/A arm here), the injected offset where one kind also
    carries a run-level term (the candidate here, sd 0.0015 beside a request se of 0.0015)."""
    import numpy as np
    import pandas as pd
    import replay_calibration as rc
    rng = np.random.default_rng(1)
    n, se, tau = 400, 0.0015, 0.0015
    half = 1.959963984540054 * se
    aa_est = rng.normal(0.0, se, n)
    cand = rng.normal(0.0, se, n) + rng.normal(0.0, tau, n)
    df = pd.DataFrame({"scenario": "aa", "aa_mean_log": aa_est, "aa_lo": aa_est - half, "aa_hi": aa_est + half,
                       "mean_log": cand, "req_lo": cand - half, "req_hi": cand + half})
    got = rc.pooled_offsets(df, n_boot=500)
    assert got["aa_arm"]["pooled_arm_sd"] < 0.0005 and 0.9 <= got["aa_arm"]["z_rms"] <= 1.1, got
    lo, hi = got["candidate"]["pooled_arm_sd_ci"]
    assert lo <= tau <= hi and abs(got["candidate"]["pooled_arm_sd"] - tau) < 0.0004, got
    assert got["candidate"]["z_rms"] > 1.3 and got["candidate"]["holding_0"] < 0.9 * n, got


def test_calibration_groups_runs_by_how_they_imported_and_built_their_arms():
    """The per-arm offsets are estimated per arm order: the recorded one, else the config's (the build
    follows the import unless set); an order that names an arm twice is refused."""
    import replay_calibration as rc
    from analysis.rawio import RunDataError
    arms = {"control": {}, "candidate": {}, "aa": {}}
    assert rc.arm_orders({"config": {}, "arms": arms}) == \
        "import control,candidate,aa; build control,candidate,aa"
    assert rc.arm_orders({"config": {"import_order": "[candidate,control,aa]"}, "arms": arms}) == \
        "import candidate,control,aa; build candidate,control,aa"
    assert rc.arm_orders({"config": {"import_order": ["candidate", "control", "aa"], "build_order": "aa,control,candidate"},
                          "arms": arms}) == "import candidate,control,aa; build aa,control,candidate"
    with pytest.raises(RunDataError, match="must name each of the arms"):
        rc.arm_orders({"config": {"build_order": "control,control,aa"}, "arms": arms})
    # a run that records its orders (every run since import_order=random): the record, whatever the config says
    assert rc.arm_orders({"config": {"import_order": "random"}, "arms": arms,
                          "arm_orders": {"import": ["aa", "control", "candidate"], "build": ["aa", "control", "candidate"]}}) \
        == "import aa,control,candidate; build aa,control,candidate"
    with pytest.raises(RunDataError, match="no arm_orders record"):     # random, but the draw is lost
        rc.arm_orders({"config": {"import_order": "random"}, "arms": arms})


def test_calibration_finds_the_penalty_of_the_first_built_arm(tmp_path):
    """A/A runs in which the arm built first (recorded in each manifest's arm_orders) runs slower by b: the
    first-built arm's penalty reads b. Negative control: the same runs with their recorded orders shuffled,
    so the slow arm is not the first one: the penalty reads ~0."""
    import json
    import random

    import replay_calibration as rc
    from analysis import synthetic

    b, n = 0.01, 12
    labels = ["control", "candidate", "aa"]
    orders = [labels[k:] + labels[:k] for k in range(3)] * (n // 3)      # each arm first in turn
    effects = {"candidate": {"latency_effect": b}, "aa": {"aa_offset": b},
               "control": {"latency_effect": -b, "aa_offset": -b}}         # control slower than both
    dirs = []
    for i, order in enumerate(orders):
        d = synthetic.write_run(tmp_path / f"aa-{i:03d}", synthetic.SyntheticSpec(
            seed=100 + i, n_requests=12, output_min=16, output_max=32, step_noise_sd=0.01, decode_noise_sd=0.001,
            spike_prob=0.0, **effects[order[0]]))
        dirs.append(d)

    def record(shuffle: bool, slow_imported_second: bool = False):
        rng = random.Random(1)
        for d, order in zip(dirs, orders):
            o = rng.sample(labels, 3) if shuffle else order
            imp = [o[1], o[0], o[2]] if slow_imported_second else o
            m = json.loads((d / "manifest.json").read_text())
            m["arm_orders"], m.setdefault("config", {})["import_order"] = {"import": imp, "build": o}, "random"
            (d / "manifest.json").write_text(json.dumps(m))
        return rc.arm_components(dirs, n_boot=50)

    got = record(shuffle=False)
    pen = got["first_built_arm"]
    assert pen["runs"] == n and abs(pen["mean"] - b) < 0.25 * b, pen
    assert got["first_imported_arm"]["mean"] == pen["mean"]
    # per quarter of the requests by context (the synthetic penalty is the same at every length)
    assert len(pen["by_context"]) == 4 and all(abs(q["mean"] - b) < 0.5 * b for q in pen["by_context"]), pen
    assert [q["range"][0] < q["range"][1] for q in pen["by_context"]] == [True] * 4
    assert [q["range"] for q in pen["by_position"]] == [[0, 2], [3, 5], [6, 8], [9, 11]]
    # every import position: the slow arm is first, so the second and the third each read -b/2 (the slow arm
    # is one of their "other two")
    for key in ("second_imported_arm", "third_imported_arm"):
        assert abs(got[key]["mean"] + b / 2) < 0.25 * b, (key, got[key])
    # the slow arm imported second (built first still): the second position carries it, the first reads -b/2
    second = record(shuffle=False, slow_imported_second=True)
    assert abs(second["second_imported_arm"]["mean"] - b) < 0.25 * b, second["second_imported_arm"]
    assert abs(second["first_imported_arm"]["mean"] + b / 2) < 0.25 * b, second["first_imported_arm"]
    assert second["first_built_arm"]["mean"] == pen["mean"]
    shuffled = record(shuffle=True)["first_built_arm"]
    assert abs(shuffled["mean"]) < 0.5 * b, shuffled


def test_calibration_tells_a_drift_over_the_run_from_a_long_context_cost(tmp_path, monkeypatch):
    """With the requests decoded in a shuffled order, a penalty of the first-built arm that grows over the run
    (only the last quarter of the decodes) reads in the last quarter by run position and is spread over the
    context quarters; one that sits in the longest contexts reads the other way round. Each case is the
    other's negative control: a split that did not follow its column would read both alike."""
    import json

    import numpy as np
    import pandas as pd
    import replay_calibration as rc

    b, n_runs, n_req = 0.01, 24, 32
    labels = ["control", "candidate", "aa"]
    rng = np.random.default_rng(5)
    dirs, frames = [], {}

    def make(kind: str):
        dirs.clear()
        frames.clear()
        for i in range(n_runs):
            d = tmp_path / kind / f"aa-{i:03d}"
            d.mkdir(parents=True)
            order = labels[i % 3:] + labels[:i % 3]
            (d / "manifest.json").write_text(json.dumps({
                "config": {"import_order": "random"}, "arms": {a: {} for a in labels}, "run_id": d.name,
                "arm_orders": {"import": order, "build": order}, **{k: {} for k in rc.rawio.MANIFEST_KEYS
                                                                   if k not in ("config", "arms", "run_id")}}))
            ctx = np.sort(rng.integers(1000, 190000, n_req))
            pos = rng.permutation(n_req)                         # run position of each request (shuffled)
            hit = (pos >= 3 * n_req // 4) if kind == "drift" else (np.arange(n_req) >= 3 * n_req // 4)
            x = rng.normal(0, 0.001, (n_req, 2))
            p = np.where(hit, b, 0.0)
            if order[0] == "control":
                x -= p[:, None]
            else:
                x[:, 0 if order[0] == "candidate" else 1] += p
            frames[d] = pd.DataFrame({"context_len": ctx, "order": 3 * pos, "tpot": x[:, 0], "aa_tpot": x[:, 1]},
                                     index=[f"r{k:02d}" for k in range(n_req)])
            dirs.append(d)
        return rc.arm_components(list(dirs), n_boot=20)["first_built_arm"]

    monkeypatch.setattr(rc, "_per_request", lambda d: frames[d])
    drift = make("drift")
    assert [q["range"] for q in drift["by_position"]] == [[0, 7], [8, 15], [16, 23], [24, 31]]
    assert abs(drift["by_position"][3]["mean"] - b) < 0.1 * b, drift
    assert all(abs(q["mean"]) < 0.1 * b for q in drift["by_position"][:3]), drift
    assert max(q["mean"] for q in drift["by_context"]) < 0.6 * b, drift       # spread: ~b/4 in each
    longctx = make("context")
    assert abs(longctx["by_context"][3]["mean"] - b) < 0.1 * b, longctx
    assert all(abs(q["mean"]) < 0.1 * b for q in longctx["by_context"][:3]), longctx
    assert max(q["mean"] for q in longctx["by_position"]) < 0.6 * b, longctx
    assert longctx["by_context"][3]["range"][0] > longctx["by_context"][0]["range"][1]


def test_calibration_joint_fit_tells_the_first_import_from_the_first_build():
    """Runs whose build order is drawn apart from the import: a penalty b on the first-imported arm reads b on
    the import and ~0 on the build, and the other way round. Negative control: runs that build in the import
    order cannot tell the two apart, and the fit says so (NaN) instead of splitting b between them."""
    import numpy as np
    import replay_calibration as rc

    b, runs = 0.01, 30
    rng = np.random.default_rng(3)
    firsts = np.array([[rng.integers(3), rng.integers(3)] for _ in range(runs)])

    def levels(which: int, firsts: np.ndarray) -> np.ndarray:
        lv = rng.normal(0, 0.0005, (runs, 2, 3))
        lv[np.arange(runs), :, firsts[:, which]] += b
        return lv - lv[:, :, :1]                      # against control, as arm_components gives them

    for which, name, other in ((1, "imported_first", "built_first"), (0, "built_first", "imported_first")):
        got = rc.first_arm_joint(levels(which, firsts), firsts, n_boot=200)
        assert got["runs_apart"] == int((firsts[:, 0] != firsts[:, 1]).sum()) > 10
        assert all(abs(m - b) < 0.1 * b for m in got[name]["mean"]), got
        assert all(abs(m) < 0.1 * b for m in got[other]["mean"]), got
        assert all(0 < e < 0.1 * b for e in got[name]["se"]), got
    same = np.repeat(firsts[:, :1], 2, axis=1)
    got = rc.first_arm_joint(levels(1, same), same, n_boot=50)
    assert got["runs_apart"] == 0 and np.isnan(got["built_first"]["mean"]).all(), got


def test_calibration_resampled_coverage_checks_the_method_on_the_runs_own_noise():
    """Independent draws from heavy-tailed per-request pools (one per context rank): the harness's request
    interval holds the truth ~95 % of the time; the negative control, the same interval shrunk to half its
    width around the mean, far less."""
    import numpy as np
    import replay_calibration as rc
    from analysis import stats
    rng = np.random.default_rng(2)
    pools = [rng.standard_t(3, 40) * (0.004 + 0.0004 * k) + 0.001 * k for k in range(32)]   # centred inside
    good = rc.resampled_coverage(pools, 300, seed=0)
    assert good["requests"] == 32 and 0.91 <= good["holding_0"] <= 0.99, good

    def shrunk(x, r):
        lo, hi = stats.bootstrap_ci(x, n_boot=300, rng=r)
        m = float(np.mean(x))
        return m - (m - lo) / 2, m + (hi - m) / 2
    bad = rc.resampled_coverage(pools, 300, seed=0, interval=shrunk)
    assert bad["holding_0"] < 0.8, bad


def _probe_dry_run(tmp_path, script: str, *args: str, out: str = "out") -> dict:
    """Run ``experiments/<script>.py --dry-run ARGS`` (its own IQUESTRT_HOME and OUT under tmp_path) and
    return the JSON it wrote."""
    import json
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..")
    env = {**os.environ, "IQUESTRT_HOME": str(tmp_path / "home"), "OUT": str(tmp_path / out)}
    r = subprocess.run([sys.executable, f"experiments/{script}.py", "--dry-run", *args],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads((tmp_path / out / f"{script}.json").read_text())


def test_import_order_probe_times_three_distinct_copies(tmp_path, monkeypatch):
    """experiments/import_order_kernels.py --dry-run (CPU interpreter): three copies of the working tree's
    runtime imported in a drawn order, each copy's attention timed over the same data with equal outputs.
    The copies must be distinct modules: one module's function timed three times (the broken variant) would
    compare a copy with itself."""
    got = _probe_dry_run(tmp_path, "import_order_kernels", "--seed", "3")
    assert sorted(got["import_order"]) == ["aa", "candidate", "control"]
    assert {(t["label"], t["import_position"]) for t in got["table"] if t["context"] == 256} == \
        {(label, i) for i, label in enumerate(got["import_order"])}
    assert all(t["outputs_equal"] for t in got["table"]) and len(got["rows"]) == 2 * 3 * 3
    for key in ("call_order", "capture_order"):
        assert sorted(got[key]) == sorted(got["import_order"]), key
    # 3 rounds of 3 copies: every copy at every place once, per context
    for n in (256, 600):
        assert sorted((x["label"], x["place"]) for x in got["rows"] if x["context"] == n) == \
            sorted((label, p) for label in got["import_order"] for p in range(3))

    # four copies, first called in an order of their own: a fourth label, four places per round
    got4 = _probe_dry_run(tmp_path, "import_order_kernels", "--seed", "2", "--copies", "4", "--call-order", "random",
                          out="out4")
    assert sorted(got4["import_order"]) == ["aa", "candidate", "control", "copy3"]
    assert sorted(got4["call_order"]) == sorted(got4["import_order"])
    assert sorted((x["label"], x["place"]) for x in got4["rows"] if x["context"] == 256) == \
        sorted((label, p) for label in got4["import_order"] for p in range(4))

    import import_order_kernels as probe
    monkeypatch.setenv("IQUESTRT_HOME", str(tmp_path / "home"))
    copies = probe.load_copies(["aa", "control", "candidate"])
    assert list(copies) == ["aa", "control", "candidate"]
    assert len({f.__module__ for f in copies.values()}) == 3 and len({id(f) for f in copies.values()}) == 3


def test_round_orders_put_every_config_at_every_place_equally():
    """_bench.round_orders: per block of k rounds each config once at each place (counts per place differ
    by at most one over any number of rounds), every config followed by every other, seeded. Negative
    control: the orders paired_rounds drew before session 60 (an independent seeded shuffle per round)
    put the first of three configs first in 74 of 200 rounds, the others in 65 and 61; the check rejects them."""
    import random

    for k in range(2, 9):
        names = [f"c{i}" for i in range(k)]
        for rounds in (k, 5 * k, 200, 201):
            o = round_orders(names, rounds)
            assert len(o) == rounds and all(sorted(x) == names for x in o)
            assert place_spread(o) <= (0 if rounds % k == 0 else 1), (k, rounds)
    names = ["a", "b", "c"]
    o = round_orders(names, 60)
    assert {(x[i], x[i + 1]) for x in o for i in range(2)} == {(a, b) for a in names for b in names if a != b}
    assert round_orders(names, 60) == o and round_orders(names, 60, seed=1) != o
    old = [random.Random(r).sample(names, 3) for r in range(200)]
    assert [sum(x[0] == n for x in old) for n in names] == [74, 65, 61]
    assert place_spread(old) == 13


def test_copy_effects_separate_a_slow_copy_from_the_first_place_in_a_round(tmp_path):
    """experiments/import_order_kernels.copy_effects on synthetic rounds: copy "b" 2 % slower everywhere,
    every copy 5 % slower when it runs first in its round, places from round_orders. It must give b
    about +1 % against the others not first (b against one other copy: half of 2 %) and the others about
    -0.5 %, and the first-place penalty +5 % for each. Negative control: the same copies timed in the old
    unbalanced orders, where "a" ran first most often, read "a" as slower over all rounds while the
    not-first comparison still finds it about equal. --analyse rebuilds the old places of a saved run."""
    import json
    import random

    import import_order_kernels as probe

    names = ["a", "b", "c"]

    def rows(orders):
        return [{"round": r, "label": lb, "place": o.index(lb),
                 "us": 10.0 * (1.02 if lb == "b" else 1.0) * (1.05 if o.index(lb) == 0 else 1.0)}
                for r, o in enumerate(orders) for lb in names]

    got = {e["label"]: e for e in probe.copy_effects(rows(round_orders(names, 201)), names)}
    assert abs(got["b"]["rel_later_pct"] - 1.0) < 0.05 and abs(got["a"]["rel_later_pct"] + 0.5) < 0.05
    assert all(abs(e["first_in_round_pct"] - 5.0) < 1e-6 for e in got.values())
    assert abs(got["a"]["rel_pct"] - got["c"]["rel_pct"]) < 1e-9       # balanced: a and c read the same
    old = [random.Random(r).sample(names, 3) for r in range(200)]
    bad = {e["label"]: e for e in probe.copy_effects(rows(old), names)}
    assert bad["a"]["rel_pct"] - bad["c"]["rel_pct"] > 0.25             # a's extra first places read as a's (0.32)
    assert abs(bad["a"]["rel_later_pct"] - bad["c"]["rel_later_pct"]) < 0.1   # (0.05: partners differ in mix)
    assert all(probe.old_place(names, r, lb) == o.index(lb) for r, o in enumerate(old) for lb in names)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"import_order": names, "rows": [
        {k: v for k, v in x.items() if k != "place"} | {"context": 7} for x in rows(old)]}))
    assert probe.analyse(path) is None


def test_import_order_steps_probe_decodes_the_same_request_in_every_copy(tmp_path, monkeypatch):
    """experiments/import_order_steps.py --dry-run (CPU, q1-tiny, eager): three copies of the runtime, built on
    one set of weights, decode forks of the same started request in balanced rounds and emit the same tokens.
    Negative control of its checks: a copy decoding its started request again without a fork finds it done,
    times no step, and its row (0 us, 0 steps) is one the checks reject."""
    got = _probe_dry_run(tmp_path, "import_order_steps", "--seed", "4")
    order = got["import_order"]
    assert sorted(order) == ["aa", "candidate", "control"] and got["model"] == "q1-tiny"
    for n in (48, 96):
        rows = [x for x in got["rows"] if x["context"] == n]
        assert sorted((x["label"], x["place"]) for x in rows) == sorted((lb, p) for lb in order for p in range(3))
        assert all(x["same_tokens"] and x["us"] > 0 and x["steps"] >= 1 for x in rows)
        assert {t["label"] for t in got["table"] if t["context"] == n} == set(order)

    import importlib
    from pathlib import Path

    import import_order_steps as probe
    import torch
    from replay import arms as armsmod
    monkeypatch.setenv("IQUESTRT_HOME", str(tmp_path / "home"))
    repo = armsmod.repo_root(Path(__file__).resolve().parent)
    arm = armsmod.load_arms(repo, {"control": armsmod.WORKTREE}, {}, order=["control"])["control"]
    rt = {"backend": "reference", "dtype": "float32", "device": "cpu", "execution": "eager"}
    eng = armsmod.build(arm, "q1-tiny", rt, armsmod.WeightCache()).engine
    fork = importlib.import_module(f"{arm.module}.graphs").fork_request
    prompt = torch.randint(0, eng.cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(48)).tolist()
    with torch.no_grad():
        rnd, st = eng.start(prompt, 0, 6)
        a, b = eng.decode(*fork(rnd, st)).tokens, eng.decode(*fork(rnd, st)).tokens
        assert a == b and probe.decode_us(eng.decode(*fork(rnd, st))) > 0
        eng.decode(rnd, st)                              # the started request itself, no fork: it is done
        again = eng.decode(rnd, st)
        assert again.step_ns == [] and probe.decode_us(again) == 0      # a row the check above rejects
