"""Draft methods in the performance model: each method's draft cost follows its physics
(a head's own weights, an MTP layer that is a slice of the target, a standalone model's
layers, no forward at all for n-gram lookup) and its acceptance is its own."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import yaml

from treetune.config import BASELINE, TreeConfig
from treetune.errors import ConfigFileError, TreetuneError
from treetune.perfmodel import (
    DEFAULT_METHOD,
    Acceptance,
    Draft,
    Method,
    PerfModel,
    check_memory,
    load_profile,
    shipped_profiles,
)
from treetune.space import load_space

QWEN35 = "qwen3.5-397b-a17b-h200"
CHAIN, TREE, WIDE = TreeConfig.of(3, 1, 4), TreeConfig.of(5, 4, 8), TreeConfig.of(5, 8, 32)
DEFAULT = load_space("default").configs()


def every_method() -> list[tuple[str, str]]:
    return [(name, method) for name in shipped_profiles()
            for method in load_profile(name).method_names]


def with_standalone(profile_name: str = QWEN35):
    """The profile plus a STANDALONE method: a 28-layer 0.8B dense model."""
    profile = load_profile(profile_name)
    draft = Draft(name="small-dense", params_m=800, kv_bytes_per_token=28_672, layers=28)
    acceptance = {d: Acceptance(top1=0.6, top1_decay=0.08) for d in profile.datasets}
    return profile.replace(methods={**profile.methods, "STANDALONE": Method(
        "standalone", acceptance, draft=draft)})


# ---- the physics of each method's draft pass ---------------------------------------------

@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("config", [CHAIN, TREE, WIDE], ids=str)
def test_ngram_lookup_has_no_draft_forward_only_a_cpu_lookup_per_request(config, batch):
    model = PerfModel(load_profile(QWEN35), method="NGRAM")
    round_ = model.round_time(config, batch, "mt-bench")
    assert round_.draft_s == 0.0
    assert model.cost.draft_pass(batch * 4, batch, 1000) == 0.0
    head = PerfModel(load_profile(QWEN35)).round_time(config, batch, "mt-bench")
    assert round_.verify_s == pytest.approx(head.verify_s)  # the same target verifies
    lookup = load_profile(QWEN35).methods["NGRAM"].lookup_us * 1e-6
    assert round_.overhead_s == pytest.approx(head.overhead_s + batch * lookup)


def test_ngram_prefill_is_the_target_alone():
    ngram, head = PerfModel(load_profile(QWEN35), method="NGRAM"), PerfModel(load_profile(QWEN35))
    assert ngram.prefill_time(CHAIN, 1, 500, "ceval") == pytest.approx(
        head.prefill_time(BASELINE, 1, 500, "ceval"))
    assert head.prefill_time(CHAIN, 1, 500, "ceval") > ngram.prefill_time(CHAIN, 1, 500, "ceval")


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_the_mtp_layer_costs_more_per_draft_pass_than_the_eagle3_head(batch):
    profile = load_profile(QWEN35)
    head, mtp = PerfModel(profile), PerfModel(profile, method="NEXTN")
    for tokens in (1, 4):
        assert mtp.cost.draft_pass(batch * tokens, batch, 1000) > \
            head.cost.draft_pass(batch * tokens, batch, 1000)
    for config in (CHAIN, TREE):
        assert mtp.round_time(config, batch, "gsm8k").draft_s > \
            head.round_time(config, batch, "gsm8k").draft_s


def test_the_mtp_pass_reads_the_targets_lm_head_and_the_head_pass_does_not():
    profile = load_profile(QWEN35)
    bigger_vocab = profile.replace(target=dataclasses.replace(
        profile.target, vocab_size=2 * profile.target.vocab_size))
    for method, grows in (("NEXTN", True), (DEFAULT_METHOD, False)):
        before = PerfModel(profile, method=method).cost.draft_pass(1, 1, 1000)
        after = PerfModel(bigger_vocab, method=method).cost.draft_pass(1, 1, 1000)
        assert (after > before) == grows, method


def test_the_mtp_pass_reads_an_unquantized_head_at_its_own_width():
    """An FP8 checkpoint keeps its lm_head in bf16: the MTP pass, which reads the head
    whole, reads twice its bytes (it was read at the quantized width)."""
    profile = load_profile(QWEN35)
    target = profile.target
    quantized = profile.replace(target=dataclasses.replace(target, weight_bytes=1.0))
    kept = profile.replace(target=dataclasses.replace(
        target, weight_bytes=1.0, unquantized_params_b=target.lm_head_params / 1e9 * 2,
        unquantized_bytes=2.0))
    cost = {name: PerfModel(p, method="NEXTN").cost for name, p in
            (("quantized", quantized), ("kept", kept))}
    extra = target.lm_head_params * 1.0 / (cost["kept"].bandwidth
                                            * profile.calibration.weight_bandwidth_eff)
    # At one token the pass is bound by its weights: the head's second byte is all of it.
    delta = cost["kept"].draft_pass(1, 1, 100) - cost["quantized"].draft_pass(1, 1, 100)
    assert delta == pytest.approx(extra, rel=1e-6)


def test_an_moe_mtp_pass_costs_more_as_its_tokens_route_to_more_experts():
    mtp = PerfModel(load_profile(QWEN35), method="NEXTN").cost
    times = [mtp.draft_pass(n, n, 100) for n in (1, 8, 64, 512, 4096)]
    assert all(b > a for a, b in itertools.pairwise(times))
    dense = load_profile(QWEN35).methods["NEXTN"]
    no_moe = dataclasses.replace(dense, mtp=dataclasses.replace(dense.mtp, routed_experts=False))
    flat = PerfModel(load_profile(QWEN35).replace(
        methods={"NEXTN": no_moe}), method="NEXTN").cost
    assert flat.draft_pass(64, 64, 100) < mtp.draft_pass(64, 64, 100)


def test_a_standalone_model_pays_its_layers_all_reduces_where_a_one_layer_head_pays_one():
    profile = with_standalone()
    standalone = PerfModel(profile, method="STANDALONE").cost
    same_size_head = dataclasses.replace(profile.methods["STANDALONE"], drafter="head",
                                         draft=dataclasses.replace(
                                             profile.methods["STANDALONE"].draft, layers=1))
    head = PerfModel(profile.replace(methods={"HEAD": same_size_head}), method="HEAD").cost
    assert standalone.draft_pass(1, 1, 1000) > head.draft_pass(1, 1, 1000)


@pytest.mark.parametrize(("name", "method"), every_method())
def test_accept_length_never_exceeds_steps_plus_one_for_any_method(name, method):
    model = PerfModel(load_profile(name), method=method)
    for dataset in model.profile.datasets:
        for config in DEFAULT:
            assert 1.0 <= model.accept_length(config, dataset) <= config.steps + 1 + 1e-12


@pytest.mark.parametrize(("name", "method"), every_method())
def test_sampled_acceptance_follows_each_methods_own_expected_accept_length(name, method):
    import numpy as np

    model = PerfModel(load_profile(name), method=method)
    dataset = next(iter(model.profile.datasets))
    sampled = model.sample_accepted(TREE, dataset, np.random.default_rng(0), 40_000)
    assert 1 + sampled.mean() == pytest.approx(model.accept_length(TREE, dataset), abs=0.03)


def test_each_method_accepts_with_its_own_acceptance():
    profile = load_profile(QWEN35)
    lengths = {m: PerfModel(profile, method=m).accept_length(CHAIN, "mt-bench")
               for m in profile.method_names}
    assert lengths["NGRAM"] < lengths[DEFAULT_METHOD] < lengths["NEXTN"]


# ---- the default method is today's model -------------------------------------------------

@pytest.mark.parametrize("name", shipped_profiles())
def test_the_default_method_is_the_profiles_own_draft_head_unchanged(name):
    profile = load_profile(name)
    default, named = PerfModel(profile), PerfModel(profile, method=DEFAULT_METHOD)
    assert default.method_name == named.method_name == DEFAULT_METHOD
    for dataset in profile.datasets:
        for config in (BASELINE, CHAIN, TREE):
            for batch in (1, 32):
                assert default.predict(config, dataset, batch) == named.predict(
                    config, dataset, batch)
        assert default.acceptance(dataset) == profile.datasets[dataset].acceptance


@pytest.mark.parametrize("name", ["qwen3-8b-h100", "qwen3-30b-a3b-h100",
                                  "qwen3-coder-next-h200"])
def test_a_profile_of_one_draft_head_saves_without_a_methods_section(name, tmp_path):
    profile = load_profile(name)
    assert profile.methods == {} and profile.method_names == [DEFAULT_METHOD]
    profile.save(tmp_path / "p.yaml")
    assert "methods" not in yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert load_profile(tmp_path / "p.yaml").method_names == [DEFAULT_METHOD]


def test_a_profile_with_methods_round_trips_through_yaml(tmp_path):
    profile = with_standalone()
    profile.save(tmp_path / "p.yaml")
    again = load_profile(tmp_path / "p.yaml")
    assert again.method_names == [DEFAULT_METHOD, "NEXTN", "NGRAM", "STANDALONE"]
    for method in again.method_names:
        assert PerfModel(again, method=method).predict(TREE, "gsm8k", 1).spec_tok_s == \
            pytest.approx(PerfModel(profile, method=method).predict(TREE, "gsm8k", 1).spec_tok_s,
                          rel=1e-4)


# ---- memory: what each method keeps on the GPUs ------------------------------------------

def test_memory_counts_the_mtp_layers_resident_experts_and_nothing_for_ngram():
    profile = load_profile(QWEN35)

    def required(method: str) -> float:
        return check_memory(profile, CHAIN, 1, method=method).required_gb

    base = check_memory(profile, BASELINE, 1).required_gb
    # One MoE layer: 153M dense + 512 experts x 12.6M, bf16, over 8 GPUs: about 1.65 GB.
    assert required("NEXTN") - required("NGRAM") == pytest.approx(1.65, abs=0.1)
    assert required("NEXTN") > required(DEFAULT_METHOD) > required("NGRAM") > base


# ---- refusals ----------------------------------------------------------------------------

def test_a_method_the_profile_lacks_is_refused_naming_the_ones_it_has():
    with pytest.raises(TreetuneError, match=r"no draft method 'STANDALONE'.*EAGLE3, NEXTN, "
                       r"NGRAM.*methods\.STANDALONE"):
        PerfModel(load_profile(QWEN35), method="STANDALONE")
    with pytest.raises(TreetuneError, match=r"'NEXTM'.*did you mean 'NEXTN'"):
        load_profile(QWEN35).method("NEXTM")


def write_profile(tmp_path, change) -> str:
    from treetune.perfmodel.profile import resolve_profile_path

    data = yaml.safe_load(resolve_profile_path(QWEN35).read_text())
    change(data)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


BAD_METHODS = {
    "acceptance missing a dataset": (
        lambda d: d["methods"]["NEXTN"]["acceptance"].pop("ceval"),
        r"methods\.NEXTN\.acceptance.*no acceptance for dataset\(s\) ceval"),
    "acceptance for an unknown dataset": (
        lambda d: d["methods"]["NGRAM"]["acceptance"].update({"gsm8kk": {"top1": 0.3}}),
        r"methods\.NGRAM\.acceptance\.gsm8kk.*did you mean 'gsm8k'"),
    "the draft head named as a method": (
        lambda d: d["methods"].update({"EAGLE3": d["methods"]["NEXTN"]}),
        r"methods\.EAGLE3.*top-level draft"),
    "an unknown drafter": (
        lambda d: d["methods"]["NEXTN"].update({"drafter": "medusa"}),
        r"methods\.NEXTN\.drafter.*head, mtp, standalone, ngram"),
    "an mtp method without its layer": (
        lambda d: d["methods"]["NEXTN"].pop("mtp"),
        r"methods\.NEXTN\.mtp.*needs its mtp facts"),
    "a trie lookup on a method with a forward": (
        lambda d: d["methods"]["NEXTN"].update({"lookup_us": 5}),
        r"methods\.NEXTN\.lookup_us.*only an ngram method"),
    "a pass overhead on n-gram lookup": (
        lambda d: d["methods"]["NGRAM"].update({"pass_overhead_ms": 1}),
        r"methods\.NGRAM\.pass_overhead_ms"),
}


@pytest.mark.parametrize("case", BAD_METHODS)
def test_a_bad_methods_section_is_refused_naming_the_key(tmp_path, case):
    change, message = BAD_METHODS[case]
    with pytest.raises(ConfigFileError, match=message):
        load_profile(write_profile(tmp_path, change))


def test_a_draft_named_by_its_hub_name_and_by_its_cache_folder_is_one_draft(tmp_path):
    """The rule that keeps a method off a prior built from another draft took a hub name
    and its snapshot folder for two drafts (the method then went to TPE)."""
    from test_facts import cache_with, fixture

    from treetune.study.methods import _same_draft

    head = "sgl-project/qwen3-30B-A3B-eagle3"
    snapshot = cache_with(tmp_path / "hub", head).parent
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert _same_draft(head, str(snapshot), env) and _same_draft(head, f"{head}/", {})
    assert not _same_draft(head, fixture("thoughtworks/Qwen3-8B-Eagle3"), env)
    assert not _same_draft(head, str(snapshot), {"HF_HUB_CACHE": str(tmp_path / "none")})
