"""Deployment exports next to the launch scripts: SGLang config files, container argument
lists, and POOLS.md when batch sizes want different trees."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import yaml
from synthetic import BASE, NARROW, WIDE, launch, spec

from treetune.backends.sglang import config_mapping, supports_config_file
from treetune.config import BASELINE, TreeConfig
from treetune.study.export import write_outputs
from treetune.study.recommend import recommend

SECRET = "sk-do-not-leak-4242"






EVERYWHERE = launch(TreeConfig(4, 1, 5), {1: {"sharegpt": 160, "humaneval": 180},
                                          32: {"sharegpt": 1400, "humaneval": 1300}})


def written(tmp_path: Path, results=(BASE, WIDE, NARROW), **over) -> Path:
    s = spec(tmp_path, **over)
    write_outputs(s, recommend(s, list(results), BASE), s.output_dir)
    return s.output_dir


def script_argv(out: Path, name: str) -> list[str]:
    """The launch script's command, split as the shell would (without `exec`)."""
    line = (out / "launch" / f"{name}.sh").read_text().splitlines()[-1]
    return shlex.split(line.removeprefix("exec "))


def sglang_reads(config: dict) -> list[str]:
    """What SGLang's --config merger (0.5.3 on) puts before the command line: `--{key}`,
    true as the bare flag, any other value as str(value)."""
    argv: list[str] = []
    for key, value in config.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def test_config_file_support_starts_with_sglang_0_5_3():
    assert not supports_config_file("0.5.2")
    assert supports_config_file("0.5.3") and supports_config_file("0.5.3.post1")
    assert supports_config_file("0.5.23") and supports_config_file("0.6")


def test_config_files_are_written_only_for_versions_that_read_them(tmp_path):
    old = written(tmp_path / "old", sglang_version="0.5.2")
    assert not list((old / "launch").glob("*.config.yaml"))
    new = written(tmp_path / "new", sglang_version="0.5.3")
    scripts = sorted(p.name.removesuffix(".sh") for p in (new / "launch").glob("*.sh"))
    configs = sorted(p.name.removesuffix(".config.yaml")
                     for p in (new / "launch").glob("*.config.yaml"))
    assert configs == scripts and len(scripts) == 6


def test_a_config_file_parses_back_to_the_launch_scripts_flags(tmp_path):
    out = written(tmp_path, sglang_version="0.5.23")
    for name in ["mixed-batch1", "mixed-batch32", "humaneval-batch32"]:
        config = yaml.safe_load((out / "launch" / f"{name}.config.yaml").read_text())
        assert sglang_reads(config) == script_argv(out, name)[3:]


def test_config_keys_are_dashed_long_names_with_typed_values_and_bare_flags_as_true(tmp_path):
    out = written(tmp_path, server_flags={"--attention-backend": "triton",
                                          "--trust-remote-code": None,
                                          "--mem-fraction-static": "0.85"})
    config = yaml.safe_load((out / "launch" / "mixed-batch32.config.yaml").read_text())
    assert config["model-path"] == "/models/My Model $(touch pwned)"
    assert config["speculative-num-steps"] == 5 and config["max-running-requests"] == 32
    assert config["cuda-graph-max-bs-decode"] == 32
    assert config["mem-fraction-static"] == 0.85
    assert config["trust-remote-code"] is True and config["enable-metrics"] is True
    assert config["attention-backend"] == "triton" and config["host"] == "127.0.0.1"


def test_config_values_that_only_look_like_numbers_or_booleans_stay_strings():
    config = config_mapping(["--model-path", "007", "--served-model-name", "true",
                             "--revision", "1e3", "--enable-metrics", "--port", "30000"])
    assert config == {"model-path": "007", "served-model-name": "true", "revision": "1e3",
                      "enable-metrics": True, "port": 30000}
    assert yaml.safe_load(yaml.safe_dump(config)) == config


def test_args_json_is_the_launch_scripts_argv_after_the_program(tmp_path):
    out = written(tmp_path)
    for script in (out / "launch").glob("*.sh"):
        name = script.name.removesuffix(".sh")
        args = json.loads((out / "launch" / f"{name}.args.json").read_text())
        assert all(isinstance(a, str) for a in args)
        # Kubernetes expands $(VAR) in args and passes $$ as $: the model path, which
        # holds "$(touch pwned)", reaches the server as the script gives it.
        assert "/models/My Model $$(touch pwned)" in args
        assert ["python", *(a.replace("$$", "$") for a in args)] == script_argv(out, name)


@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o700), (0o022, 0o755)])
def test_launch_scripts_are_executable_as_far_as_the_umask_lets_them_be_read(
        tmp_path, umask, mode):
    """They hold the study's env; forced to 0755 they were readable by all whatever the
    umask (a helper's audit)."""
    written(tmp_path)  # an earlier run's scripts, at this test process's umask
    old = os.umask(umask)
    try:
        out = written(tmp_path)  # the rerun's mode is its own umask's
    finally:
        os.umask(old)
    scripts = list((out / "launch").glob("*.sh"))
    assert scripts and {s.stat().st_mode & 0o777 for s in scripts} == {mode}


def test_pools_readme_of_a_dataset_alone_when_the_mixed_traffic_has_one_tree(tmp_path):
    """The file began with the dataset's section and spoke of pools "above" (a review)."""
    base = launch(BASELINE, {1: {"sharegpt": 100, "humaneval": 100},
                             32: {"sharegpt": 1000, "humaneval": 1000}})
    wide = launch(TreeConfig(3, 4, 8), {1: {"sharegpt": 150, "humaneval": 125},
                                        32: {"sharegpt": 1300, "humaneval": 1030}})
    narrow = launch(TreeConfig(5, 1, 6), {1: {"sharegpt": 110, "humaneval": 130},
                                          32: {"sharegpt": 1100, "humaneval": 1020}})
    out = written(tmp_path, results=(base, wide, narrow))
    kinds = {r["workload"]: r["kind"] for r in yaml.safe_load(
        (out / "recommendations.yaml").read_text())["recommendations"]}
    assert kinds == {"mixed": "static", "humaneval": "pools", "sharegpt": "static"}
    pools = (out / "POOLS.md").read_text()
    assert "The mixed traffic is served by one tree at every batch size" in pools
    assert "## humaneval alone" in pools and "above" not in pools
    assert "| 1 | 1 | (5,1,6) | `launch/humaneval-batch1.sh` |" in pools


def test_no_speculation_recommendations_export_without_speculative_flags(tmp_path):
    out = written(tmp_path, results=(BASE, WIDE))  # WIDE regresses humaneval at batch 32
    args = json.loads((out / "launch" / "mixed-batch32.args.json").read_text())
    config = yaml.safe_load((out / "launch" / "mixed-batch32.config.yaml").read_text())
    assert "--speculative-algorithm" not in args and "speculative-algorithm" not in config
    assert config["max-running-requests"] == 32
    # Its pool loads no draft: POOLS.md said every pool loads the same target and draft.
    pools = (out / "POOLS.md").read_text()
    assert "baseline" in pools.split("### Start the servers")[0]
    assert "the same target checkpoint" in pools and "draft checkpoints" not in pools


def test_pools_readme_names_both_scripts_and_ports_behind_one_router_each(tmp_path):
    out = written(tmp_path)
    pools = (out / "POOLS.md").read_text().split("## humaneval alone")[0]  # the mixed's
    for script in ["launch/mixed-batch1.sh", "launch/mixed-batch32.sh"]:
        assert script in pools
    commands = [shlex.split(line) for line in pools.splitlines()
                if line.startswith("python -m sglang.launch_server --model-path")]
    assert len(commands) == 2
    ports = [c[c.index("--port") + 1] for c in commands]
    assert len(set(ports)) == 2
    assert [c[c.index("--speculative-eagle-topk") + 1] for c in commands] == ["4", "1"]
    routers = [shlex.split(line) for line in pools.splitlines()
               if line.startswith("python -m sglang_router.launch_router")]
    assert [r[r.index("--worker-urls") + 1] for r in routers] == [
        f"http://127.0.0.1:{port}" for port in ports]
    assert len({r[r.index("--port") + 1] for r in routers}) == 2
    assert len({r[r.index("--prometheus-port") + 1] for r in routers}) == 2


def test_a_dataset_served_alone_whose_batch_sizes_want_different_trees_has_its_pools(
        tmp_path):
    """humaneval alone wants (3,4,8) at batch 1 and (5,1,6) at batch 32 (its advice is
    `pools` in recommendations.yaml), sharegpt alone (3,4,8) at both: POOLS.md gave the
    mixed traffic's pools only (a helper's audit)."""
    out = written(tmp_path)
    recs = yaml.safe_load((out / "recommendations.yaml").read_text())
    kinds = {r["workload"]: r["kind"] for r in recs["recommendations"]}
    assert kinds == {"mixed": "pools", "humaneval": "pools", "sharegpt": "static"}
    mixed, alone = (out / "POOLS.md").read_text().split("## humaneval alone")
    assert "sharegpt" not in alone and "sharegpt" not in mixed
    for script in ["launch/humaneval-batch1.sh", "launch/humaneval-batch32.sh"]:
        assert script in alone and script not in mixed
    servers = [shlex.split(line) for line in (mixed + alone).splitlines()
               if line.startswith("python -m sglang.launch_server --model-path")]
    routers = [shlex.split(line) for line in alone.splitlines()
               if line.startswith("python -m sglang_router.launch_router")]
    ports = [c[c.index("--port") + 1] for c in servers]
    assert len(ports) == 4 and len(set(ports)) == 4  # every pool its own ports
    assert [r[r.index("--worker-urls") + 1] for r in routers] == [
        f"http://127.0.0.1:{port}" for port in ports[2:]]
    assert "| 3 | 1 | (3,4,8) | `launch/humaneval-batch1.sh` |" in alone


def test_pools_on_one_host_bind_no_port_twice_with_data_parallel_attention(tmp_path):
    """With data-parallel attention SGLang binds ports derived from --port (PortArgs:
    --port + 233 to + 240; the DP handshake at --port + 13): pools on consecutive ports
    shared six of them, and the second pool never started (a helper's audit)."""
    pools = (written(tmp_path) / "POOLS.md").read_text()
    lines = [shlex.split(line) for line in pools.splitlines()
             if line.startswith(("python -m sglang.launch_server --model-path",
                                 "python -m sglang_router.launch_router"))]
    taken: list[int] = []
    for argv in lines:
        port = int(argv[argv.index("--port") + 1])
        if "sglang.launch_server" in argv:
            taken += [port, port + 13, *range(port + 233, port + 241)]
        else:
            taken += [port, int(argv[argv.index("--prometheus-port") + 1])]
    assert len(lines) == 8 and len(taken) == len(set(taken)), sorted(taken)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3"])
def test_the_routers_listen_where_the_study_s_servers_do(tmp_path, host):
    pools = (written(tmp_path, host=host) / "POOLS.md").read_text()
    routers = [shlex.split(line) for line in pools.splitlines()
               if line.startswith("python -m sglang_router.launch_router")]
    assert routers and all(r[r.index("--host") + 1] == host for r in routers)
    assert ("only this machine reaches them" in pools) == (host == "127.0.0.1")


def test_pools_readme_is_absent_when_one_tree_serves_every_batch_size(tmp_path):
    out = written(tmp_path, results=(BASE, WIDE, NARROW, EVERYWHERE))
    assert not (out / "POOLS.md").exists()
    assert "pools" not in (out / "recommendations.yaml").read_text()


def test_a_rerun_whose_advice_changed_removes_the_stale_pools_readme(tmp_path):
    s = spec(tmp_path)
    write_outputs(s, recommend(s, [BASE, WIDE, NARROW], BASE), s.output_dir)
    assert (s.output_dir / "POOLS.md").exists()
    write_outputs(s, recommend(s, [BASE, WIDE, NARROW, EVERYWHERE], BASE), s.output_dir)
    assert not (s.output_dir / "POOLS.md").exists()


def test_exports_reference_the_api_key_variable_and_never_its_value(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVER_KEY", SECRET)
    out = written(tmp_path, api_key_env="SERVER_KEY")
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} >= {".sh", ".json", ".yaml", ".md"}
    for path in files:
        assert SECRET not in path.read_text(), path
    args = json.loads((out / "launch" / "mixed-batch1.args.json").read_text())
    assert args[-2:] == ["--api-key", "$(SERVER_KEY)"]  # Kubernetes expands $(VAR) in args
    config = (out / "launch" / "mixed-batch1.config.yaml").read_text()
    key = ('--api-key "${SERVER_KEY:?is unset or empty: the server would run without an API '
           'key}"')
    assert "api-key" not in yaml.safe_load(config) and key in config
    pools = (out / "POOLS.md").read_text()
    assert pools.count(key) >= 4  # two servers, two routers


def test_a_launch_script_stops_when_its_api_key_variable_is_unset(tmp_path, monkeypatch):
    """SGLang takes an empty --api-key as none: a script run without the variable would
    serve with no authentication. It stops before the server starts; with the variable
    set, the server gets its value. The script runs the study's interpreter."""
    import os
    import subprocess

    out = written(tmp_path, api_key_env="SERVER_KEY",
                  backend={"kind": "sglang", "python": "sglang-python"})
    stub = tmp_path / "bin" / "sglang-python"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    stub.chmod(0o755)
    script = out / "launch" / "mixed-batch1.sh"
    env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args")}
    for value in (None, ""):
        run_env = env if value is None else {**env, "SERVER_KEY": value}
        done = subprocess.run(["sh", str(script)], env=run_env, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode != 0 and "SERVER_KEY: is unset or empty" in done.stderr
        assert not (tmp_path / "args").exists()
    done = subprocess.run(["sh", str(script)], env={**env, "SERVER_KEY": SECRET},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:2] == ["-m", "sglang.launch_server"] and args[-2:] == ["--api-key", SECRET]


def test_production_servers_with_attention_groups_hold_a_whole_share_of_their_batch_each(
        tmp_path):
    """SGLang 0.5.23 gives each data-parallel attention group max_running_requests //
    groups requests (at least one): a server sized 6 over 4 groups ran 4 at once, so it is
    sized 8; batch 1 takes 4 (one a group, as SGLang would give 1)."""
    import dataclasses

    from treetune.study.export import launch_argv

    s = spec(tmp_path, tp=4, server_flags={"--attn-dp-size": 4})
    recs = recommend(s, [BASE, WIDE, NARROW], BASE)
    sized = {}
    for batch in (1, 6, 32):
        argv = launch_argv(s, dataclasses.replace(recs[0], batch=batch))
        sized[batch] = int(argv[argv.index("--max-running-requests") + 1])
    assert sized == {1: 4, 6: 8, 32: 32}


def test_a_batch_1_script_with_two_gpus_per_attention_group_leaves_a_graph_to_capture(
        tmp_path):
    """SGLang captures only multiples of an attention group's GPUs there: capped at 1,
    the batch-1 script captured nothing and failed at start-up (a helper's audit)."""
    import dataclasses

    from treetune.study.export import launch_argv

    s = spec(tmp_path, tp=8, server_flags={"--attn-dp-size": 4})
    recs = recommend(s, [BASE, WIDE, NARROW], BASE)
    caps = {}
    for batch in (1, 32):
        argv = launch_argv(s, dataclasses.replace(recs[0], batch=batch))
        caps[batch] = int(argv[argv.index("--cuda-graph-max-bs-decode") + 1])
    assert caps == {1: 2, 32: 32}


def test_flags_sglangs_config_reader_refuses_stay_on_the_command_line_after_the_file(tmp_path):
    """SGLang 0.5.23's --config reader takes plain store_true flags only: a config file
    holding `enable-dp-attention: true` (a deprecated switch) or a --no-X failed at start-up
    (a helper ran 0.5.23's parser on it); they follow the file on its command line."""
    out = written(tmp_path, tp=2, server_flags={"--enable-dp-attention": None, "--dp-size": "2",
                                                "--no-enable-tf32-matmul": None,
                                                "--trust-remote-code": None})
    text = (out / "launch" / "mixed-batch32.config.yaml").read_text()
    config = yaml.safe_load(text)
    assert "enable-dp-attention" not in config and "no-enable-tf32-matmul" not in config
    assert config["dp-size"] == 2 and config["trust-remote-code"] is True
    command = shlex.split(text.splitlines()[0].split(": ", 1)[1])
    assert command[-3:] == ["launch/mixed-batch32.config.yaml", "--enable-dp-attention",
                            "--no-enable-tf32-matmul"], command
    # The file and the flags after it are the launch script's flags, as SGLang merges them.
    assert sorted(sglang_reads(config) + command[-2:]) == sorted(
        script_argv(out, "mixed-batch32")[3:])
