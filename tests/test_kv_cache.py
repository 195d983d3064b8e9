"""What a target's KV cache costs: MLA latents and sliding-window layers, described in a
profile, change the bytes a decode step reads and the memory a request holds."""

import pytest
import yaml

from treetune.config import BASELINE
from treetune.errors import ConfigFileError
from treetune.perfmodel import CostModel, check_memory, load_profile

BASE = load_profile("qwen3-8b-h100").to_dict()


def profile_file(tmp_path, target: dict, **hardware):
    data = {**BASE, "name": "t", "target": {**BASE["target"], **target},
            "hardware": {**BASE["hardware"], **hardware}}
    data["target"] = {k: v for k, v in data["target"].items() if v is not None}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# DeepSeek-V3: 61 layers, a 512-wide latent plus a 64-wide RoPE key per token and layer.
DEEPSEEK_MLA = {"mla": {"kv_lora_rank": 512, "rope_dim": 64}, "layers": 61,
                "attention_layers": None, "kv_bytes_per_token": None}


def test_an_mla_target_takes_its_kv_bytes_per_token_from_the_latent(tmp_path):
    target = load_profile(profile_file(tmp_path, DEEPSEEK_MLA)).target
    assert target.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70272
    assert target.kv_bytes(1000) == 1000 * 70272
    # The same latent with an fp8 KV cache holds half as much.
    fp8 = {**DEEPSEEK_MLA, "mla": {**DEEPSEEK_MLA["mla"], "bytes_per_element": 1}}
    assert load_profile(profile_file(tmp_path, fp8)).target.kv_bytes_per_token == 35136


def test_a_kv_size_that_contradicts_the_mla_latent_names_the_key_and_its_line(tmp_path):
    path = profile_file(tmp_path, {**DEEPSEEK_MLA, "kv_bytes_per_token": 1000})
    with pytest.raises(ConfigFileError) as exc:
        load_profile(path)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1)
                if "kv_bytes_per_token" in text)
    assert f"line {line}" in str(exc.value) and "target.kv_bytes_per_token" in str(exc.value)
    assert "70272" in str(exc.value)


def test_every_tensor_parallel_rank_reads_and_holds_the_whole_mla_latent(tmp_path):
    mla = load_profile(profile_file(tmp_path, DEEPSEEK_MLA, gpus=8))
    gqa = load_profile(profile_file(
        tmp_path, {**DEEPSEEK_MLA, "mla": None, "kv_bytes_per_token": 70272}, gpus=8))
    assert mla.target.kv_bytes_per_token == gqa.target.kv_bytes_per_token
    data = mla.dataset("sharegpt").__class__(acceptance=mla.dataset("sharegpt").acceptance,
                                             context_tokens=30000)
    # Same bytes per token, but TP 8 splits K and V heads and cannot split the latent:
    # at a long context the MLA step reads 8x the KV, and each GPU holds all of it.
    slow = CostModel(mla).target_pass(32, 1, data) - CostModel(gqa).target_pass(32, 1, data)
    cal = mla.calibration
    kv_one_copy = 32 * 30000 * 70272 / (8 * mla.hardware.bandwidth_tb_s * 1e12
                                        * cal.kv_bandwidth_eff)
    assert slow == pytest.approx(7 * kv_one_copy, rel=1e-6)
    held = check_memory(mla, BASELINE, 8).required_gb - check_memory(gqa, BASELINE, 8).required_gb
    kv_per_gpu = 8 * mla.server.reserve_context_tokens * 70272 / 1e9
    assert held == pytest.approx(kv_per_gpu * (1 - 1 / 8), rel=1e-6)


# gpt-oss-like: 36 attention layers, half of them with a 128-token window.
WINDOWED = {"layers": 36, "attention_layers": 36, "kv_bytes_per_token": 36 * 2048,
            "sliding_window": {"window": 128, "layers": 18}}


def test_sliding_window_layers_read_no_more_than_their_window(tmp_path):
    target = load_profile(profile_file(tmp_path, WINDOWED)).target
    per_layer = 2048
    assert target.kv_bytes(100) == 100 * 36 * per_layer  # inside the window: all layers
    assert target.kv_bytes(4096) == per_layer * (18 * 4096 + 18 * 128)
    # Past the window, one more token of context costs only the full layers.
    assert target.kv_bytes(8001) - target.kv_bytes(8000) == 18 * per_layer


def test_a_decode_step_reads_the_windowed_kv_and_the_pool_holds_it(tmp_path):
    windowed = load_profile(profile_file(tmp_path, WINDOWED))
    full = load_profile(profile_file(tmp_path, {**WINDOWED, "sliding_window": None}))
    ctx = 8000
    data = windowed.dataset("sharegpt").__class__(
        acceptance=windowed.dataset("sharegpt").acceptance, context_tokens=ctx)
    saved = CostModel(full).target_pass(16, 1, data) - CostModel(windowed).target_pass(16, 1, data)
    cal, hw = windowed.calibration, windowed.hardware
    expected = 16 * 18 * 2048 * (ctx - 128) / (hw.bandwidth_tb_s * 1e12 * cal.kv_bandwidth_eff)
    assert saved == pytest.approx(expected, rel=1e-6)
    assert check_memory(windowed, BASELINE, 64).required_gb < \
        check_memory(full, BASELINE, 64).required_gb


def test_a_window_on_more_layers_than_hold_kv_is_refused(tmp_path):
    path = profile_file(tmp_path, {**WINDOWED, "sliding_window": {"window": 128, "layers": 40}})
    with pytest.raises(ConfigFileError, match=r"target\.sliding_window\.layers"):
        load_profile(path)


def test_mla_and_windows_survive_a_save_and_load(tmp_path):
    for target in (DEEPSEEK_MLA, WINDOWED):
        profile = load_profile(profile_file(tmp_path, target))
        again = tmp_path / "again.yaml"
        profile.save(again)
        assert load_profile(again).target == profile.target
