"""Capability evaluation: loom's lm-evaluation-harness adapter against the harness's own `hf` backend on the same
run exported to transformers (same requests, same numbers), CORE's scoring rules, `loom eval --tasks/--suite
core/--runs`, the in-loop evaluator, and the bad inputs (unknown task, missing data, broken bundle, no
end-of-text). All task data is made here (tests/evalkit.py): nothing is downloaded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import types

import pytest
import torch
from evalkit import TASKS, TINY, prepare_data, write_bundle, write_tasks
from loomrun import LOOM, loom_here

from loom.cli import main
from loom.errors import LoomError
from loom.eval import core, harness
from loom.metrics import read_jsonl
from loom.runs import load_run

pytest.importorskip("lm_eval", reason="the eval extra (make test installs it)")


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    data = prepare_data(root)
    tasks, bundle = write_tasks(root), write_bundle(root)
    loom_here(
        "train",
        f"--data.path={data}",
        f"--run.dir={root}",
        "--run.name=r",
        "--train.steps=30",
        *TINY,
        "--train.log_every=10",
        f"--eval.tasks={TASKS}",
        f"--eval.include_path={tasks}",
        f"--eval.core_bundle={bundle}",
        "--eval.every=15",
        "--train.ckpt_every=15",
        "--train.keep_last=3",
    )
    run = root / "r"
    loom_here("export", str(run), "--format", "hf", "--out", str(root / "hf"))
    return types.SimpleNamespace(root=root, data=data, tasks=tasks, bundle=bundle, run=run, hf=root / "hf")


def _lms(kit, batch_size=4):
    from lm_eval.models.huggingface import HFLM

    cfg, model, tok, _, _ = load_run(kit.run, torch.device("cpu"))
    loom = harness.make_lm(model, tok, torch.device("cpu"), batch_size=batch_size)
    hf = HFLM(pretrained=str(kit.hf), device="cpu", batch_size=1, dtype="float32")
    return loom, hf


def _requests(loaded) -> dict[str, list]:
    by_type: dict[str, list] = {}
    for task in loaded["tasks"].values():
        task.build_all_requests(limit=None, rank=0, world_size=1)
        for inst in task.instances:
            by_type.setdefault(inst.request_type, []).append(inst)
    return by_type


def test_adapter_answers_every_request_as_the_hf_backend(kit):
    """Each request type, request by request: loom's adapter (batched 4 at a time, by length) and the harness's
    hf backend (one at a time) on the exported model give the same log-likelihoods, greedy flags, rolling
    log-likelihoods and generated texts; and so the same metrics through the harness's evaluate."""
    loom, hf = _lms(kit)
    reqs = _requests(harness.load_tasks(TASKS, str(kit.tasks)))
    assert set(reqs) == {"loglikelihood", "loglikelihood_rolling", "generate_until"}
    ours, theirs = loom.loglikelihood(reqs["loglikelihood"]), hf.loglikelihood(reqs["loglikelihood"])
    assert len(ours) == len(theirs) == 24 * 4 + 24 * 2 + 24
    for (a, ga), (b, gb) in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4) and ga == gb
    rolled = loom.loglikelihood_rolling(reqs["loglikelihood_rolling"])
    assert rolled == pytest.approx(hf.loglikelihood_rolling(reqs["loglikelihood_rolling"]), rel=1e-5)
    texts = loom.generate_until(reqs["generate_until"])
    assert texts == hf.generate_until(reqs["generate_until"])
    assert sum(bool(t.strip()) for t in texts) >= len(texts) // 2  # real text, cut at the stop
    assert not any("\n" in t for t in texts)
    from lm_eval.api.instance import (
        Instance,  # the model's own greedy texts as continuations: greedy flags True
    )

    own = [
        Instance("loglikelihood", {}, (inst.args[0], t), 0)
        for inst, t in zip(reqs["generate_until"], texts, strict=True)
        if t.strip()
    ]
    ours, theirs = loom.loglikelihood(own), hf.loglikelihood(own)
    assert [g for _, g in ours] == [g for _, g in theirs] and sum(g for _, g in ours) >= len(own) // 2

    a = harness.scores(harness.evaluate(loom, harness.load_tasks(TASKS, str(kit.tasks))))
    b = harness.scores(harness.evaluate(hf, harness.load_tasks(TASKS, str(kit.tasks))))
    assert a.keys() == b.keys() and "evkit_mc/acc" in a and "evkit_roll/word_perplexity" in a
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5), k


def test_core_equals_the_hf_backend_request_by_request(kit):
    loom, hf = _lms(kit)
    tasks = core.read_bundle(kit.bundle)
    assert [t.kind for t in tasks] == ["multiple_choice", "schema", "language_modeling"]
    for task in tasks:
        for i in range(len(task.examples)):
            mine, theirs = core.requests(task, i, loom), core.requests(task, i, hf)
            assert mine == theirs  # the same token ids: loom's tokenizer is the exported one
            flat = [(None, c, x) for c, x in mine]
            for (a, ga), (b, gb) in zip(
                loom._loglikelihood_tokens(flat), hf._loglikelihood_tokens(flat), strict=True
            ):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-4) and ga == gb
    r, r_hf = core.evaluate(loom, tasks), core.evaluate(hf, tasks)
    assert r["accuracy"] == r_hf["accuracy"] and r["core"] == pytest.approx(r_hf["core"])
    assert r["n"] == {"kit_mc": 24, "kit_schema": 24, "kit_lm": 24}


class _FakeLM:
    """A TemplateLM's face for CORE: characters are tokens; the loss of a continuation is set per text."""

    prefix_token_id, rank, world_size = 0, 0, 1

    def __init__(self, loss_of: dict[str, float], greedy: set[str] = frozenset()):
        self.loss_of, self.greedy, self.seen = loss_of, greedy, []

    def tok_encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def _loglikelihood_tokens(self, flat, disable_tqdm=False):
        out = []
        for _, ctx, cont in flat:
            text = "".join(chr(t) for t in cont)
            self.seen.append(("".join(chr(t) for t in ctx[1:]), text))
            out.append((-self.loss_of.get(text, 5.0) * len(cont), text in self.greedy))
        return out

    def gather_object(self, obj, dst=0):
        return [obj]


def test_core_scores_as_nanochat_does(tmp_path):
    """Multiple choice: the common prefix is context, the lowest MEAN loss wins; schema: the common suffix is
    scored; language modelling: right when greedy; each accuracy centred on its random baseline."""
    mc = core.CoreTask(
        "mc",
        "multiple_choice",
        1,
        ": ",
        0.25,
        [
            {"query": "q0", "choices": ["aa", "b"], "gold": 0},
            {"query": "q1", "choices": ["cc", "d"], "gold": 1},
        ],
    )
    assert core.prompts(mc, 0) == ["q1: d\n\nq0: aa", "q1: d\n\nq0: b"]  # the other example, its gold choice
    fake = _FakeLM({"aa": 1.0, "b": 1.5, "cc": 1.0, "d": 1.2})  # means: aa wins (right), cc wins (wrong)
    r = core.evaluate(fake, [mc])
    assert r["accuracy"] == {"mc": 0.5} and r["centered"]["mc"] == pytest.approx((0.5 - 0.25) / 0.75)
    assert ("q1: d\n\nq0: ", "aa") in fake.seen
    schema = core.CoreTask(
        "s",
        "schema",
        0,
        " ",
        0.5,
        [{"context_options": ["he ran", "she sat"], "continuation": "home", "gold": 1}],
    )
    fake = _FakeLM({" home": 2.0})
    assert core.evaluate(fake, [schema])["accuracy"] == {"s": 0.0}  # equal losses: the first option
    assert [s for s in fake.seen] == [("he ran", " home"), ("she sat", " home")]
    lm = core.CoreTask(
        "l",
        "language_modeling",
        0,
        " ",
        0.0,
        [{"context": "one two ", "continuation": "three"}, {"context": "a b", "continuation": "c"}],
    )
    fake = _FakeLM({}, greedy={" three"})
    r = core.evaluate(fake, [lm])
    assert r["accuracy"] == {"l": 0.5} and r["core"] == pytest.approx(0.5)
    assert fake.seen[0] == ("one two", " three")  # the context trimmed, the delimiter scored with the answer


def test_in_loop_records_equal_loom_eval_of_the_checkpoint(kit, capsys):
    """The run scored its tasks and CORE at steps 15 and 30; `loom eval` on the step-15 checkpoint gives the
    same figures (and writes them to <run>/evals/step_15.json and --json)."""
    recs = [r for r in read_jsonl(kit.run / "metrics.jsonl") if "core" in r]
    assert [r["step"] for r in recs] == [15, 30]
    step15 = kit.run / "ckpt" / "step_000015"
    out = kit.root / "new" / "e.json"  # a folder --json makes (it was a traceback after the whole evaluation)
    assert (
        main(
            [
                "eval",
                str(kit.run),
                "--tasks",
                TASKS,
                "--include-path",
                str(kit.tasks),
                "--suite",
                "core",
                "--bundle",
                str(kit.bundle),
                "--json",
                str(out),
                "--device",
                "cpu",
                "--batch-size",
                "3",
                "--ckpt",
                str(step15),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "evkit_mc" in text and "CORE" in text and "acc_norm" in text
    written = json.loads(out.read_text())
    assert written == json.loads((kit.run / "evals" / "step_15.json").read_text()) and written["step"] == 15
    for k, v in written["scores"].items():
        assert recs[0][k] == pytest.approx(v, rel=1e-5), k
    assert recs[0]["lm_eval/evkit_roll/word_perplexity"] != recs[1]["lm_eval/evkit_roll/word_perplexity"]
    assert 0.0 <= written["scores"]["lm_eval/evkit_mc/acc"] <= 1.0 and math.isfinite(
        written["scores"]["core"]
    )


def test_plot_draws_the_scores_against_tokens(kit, tmp_path):
    import struct

    from loom.plot import plot_runs

    png = plot_runs([kit.run], tmp_path / "p.png").read_bytes()
    width = struct.unpack(">I", png[16:20])[0]  # the PNG header's width: 6.5 in per panel at 110 dpi
    assert width == int(3 * 6.5 * 110)  # loss, val bits per byte, capability scores


def test_several_runs_give_mean_and_spread(kit, capsys):
    assert (
        main(
            [
                "eval",
                "--runs",
                str(kit.run),
                str(kit.run),
                "--suite",
                "core",
                "--bundle",
                str(kit.bundle),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("core "))
    assert "± 0.0000" in line and "over 2 runs" in out


@pytest.mark.slow  # lm_eval indexes every task YAML it ships to find the nearest name: ~1 min of CPU
def test_unknown_task_names_the_nearest(kit):
    with pytest.raises(LoomError, match="no task 'helaswag'.*'hellaswag'"):
        harness.load_tasks("helaswag")
    with pytest.raises(LoomError, match="no task 'evkit_mcc'.*'evkit_mc'"):
        harness.load_tasks("evkit_mcc", str(kit.tasks))  # not in the folder: the whole index is searched


def _task_yaml(d, task: str, data_file, text: str = "{{question}}", more: str = "") -> None:
    (d / f"{task}.yaml").write_text(
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_file}\n"
        f"test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{text}'\ndoc_to_target: '{{{{label}}}}'\n{more}"
    )


@pytest.mark.slow  # each fault is looked up in lm_eval's index of every task it ships
def test_task_yaml_faults_are_named_before_any_model(tmp_path):
    """What is wrong in a task YAML, named: it was 'no task named ...' for a YAML that does not parse, 'cannot
    be read offline' with a network hint for a missing local file or a template field the documents lack, and
    a traceback mid-evaluation for more few-shot examples than the task has."""
    d = write_tasks(tmp_path, n=6)
    mc = d / "mc.jsonl"
    (d / "broken.yaml").write_text("task: evkit_broken\ndataset_path: json\n  test_split: [\n")
    unparsed = (
        "no task 'evkit_broken': the task YAML '.*broken.yaml' under --include-path does not parse: mapping "
        "values are not allowed here at line 3, column 13"
    )
    with pytest.raises(LoomError, match=unparsed):
        harness.load_tasks("evkit_broken", str(d))
    with pytest.raises(LoomError, match="the task YAML '.*broken.yaml' does not parse"):
        harness.load_tasks(str(d / "broken.yaml"))  # a YAML named by path
    (d / "broken.yaml").unlink()
    _task_yaml(d, "evkit_gone", tmp_path / "none.jsonl")
    _task_yaml(d, "evkit_field", mc, text="{{nope}}")
    missing = r"task 'evkit_gone' \(.*evkit_gone.yaml\): its data file '.*none.jsonl' does not exist"
    with pytest.raises(LoomError, match=missing) as e:
        harness.load_tasks("evkit_gone", str(d))
    assert "dataset_kwargs.data_files" in e.value.hint and "offline" not in str(e.value)
    field = "task 'evkit_field' .*: a template of the task fails on its documents: UndefinedError: 'nope' is"
    with pytest.raises(LoomError, match=field) as e:
        harness.load_tasks("evkit_field", str(d))
    assert "doc_to_text" in e.value.hint and "offline" not in str(e.value)
    # few-shot examples: 6 documents (the test split, drawn from as it is not named the fewshot split)
    with pytest.raises(LoomError, match="--num-fewshot 7: task 'evkit_mc' has 6 document"):
        harness.load_tasks("evkit_mc", str(d), num_fewshot=7)
    assert harness.load_tasks("evkit_mc", str(d), num_fewshot=6)
    _task_yaml(d, "evkit_own", mc, more="fewshot_split: test\nnum_fewshot: 6\n")
    own = (
        r"num_fewshot 6 \(the task's own\): task 'evkit_own' has 5 document\(s\) to draw few-shot examples from "
        r"\(its split less the document evaluated\)"
    )
    with pytest.raises(LoomError, match=own):
        harness.load_tasks("evkit_own", str(d))


def test_missing_task_data_says_what_to_fetch(kit, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "hub.yaml").write_text(
        "task: gone_hub\ndataset_path: loom-tests/no-such-dataset\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{a}}'\ndoc_to_target: '{{b}}'\n"
    )
    # a hub dataset offline (the variables are read when datasets is imported: a process of its own)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run(
        [*LOOM, "eval", str(kit.run), "--tasks", "gone_hub", "--include-path", str(d)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "data of task 'gone_hub'" in r.stderr and "cannot be read offline" in r.stderr
    assert "datasets cache" in r.stderr and "checkpoint" not in r.stdout  # before any model was read


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no_yaml", "no core.yaml"),
        ("kind", "of type 'ranking'"),
        ("fields", "needs query, choices, gold"),
        ("baseline", "no random baseline for task 'kit_lm'"),
        ("gold", "'gold' must index"),
    ],
)
def test_broken_bundle_is_refused(tmp_path, breakage, message):
    b = write_bundle(tmp_path, n=6)
    if breakage == "no_yaml":
        (b / "core.yaml").unlink()
    elif breakage == "kind":
        (b / "core.yaml").write_text(
            (b / "core.yaml").read_text().replace("icl_task_type: schema", "icl_task_type: ranking")
        )
    elif breakage == "fields":
        (b / "eval_data" / "mc.jsonl").write_text('{"question": "q", "choices": ["a"], "gold": 0}\n')
    elif breakage == "baseline":
        (b / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nkit_mc,25\nkit_schema,50\n")
    else:
        (b / "eval_data" / "mc.jsonl").write_text('{"query": "q", "choices": ["a", "b"], "gold": 2}\n')
    with pytest.raises(LoomError, match=message):
        core.read_bundle(b)


def test_tokenizer_problems_are_refused(kit):
    from loom.data.tokenizers import CharTokenizer

    model = types.SimpleNamespace(cfg=types.SimpleNamespace(block_size=8, vocab_size=65))
    with pytest.raises(LoomError, match="no end-of-text"):
        harness.make_lm(model, types.SimpleNamespace(eot_id=None, vocab_size=5), "cpu")
    with pytest.raises(LoomError, match="end-of-text id 65 is outside the model's vocabulary of 65"):
        harness.make_lm(
            model, CharTokenizer([chr(33 + i) for i in range(65)]), "cpu"
        )  # nanogpt's 65 characters
    with pytest.raises(LoomError, match="without a tokenizer"):
        harness.make_lm(model, None, "cpu")
    with pytest.raises(LoomError, match="task 'evkit_mc', document 0: character 'o' is not in"):
        harness.check_encodable(harness.load_tasks("evkit_mc", str(kit.tasks)), CharTokenizer(list("xyz")))


def test_cli_refuses_ignored_options_and_makes_the_json_folder_first(tmp_path, capsys):
    """Options one evaluation would ignore beside another are refused (--bundle without --suite computed the
    validation loss; --task beside --tasks was dropped); --json's folder is made before the tasks are read."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("", encoding="utf-8")  # refused before any model: none is read
    tasks = write_tasks(tmp_path, n=6)
    cases = [
        (["--bundle", str(tmp_path)], "--bundle is read by --suite core"),
        (
            ["--tasks", "evkit_mc", "--task", "hellaswag", "--data", "x.jsonl"],
            "--task, --data are options of the validation loss and HellaSwag evaluation, which --tasks",
        ),
        (
            ["--suite", "core", "--bundle", str(tmp_path), "--task=val"],
            "--task is an option of the validation",
        ),
        (["--json", str(tmp_path / "e.json")], "--json is an option of capability evaluation"),
        (
            ["--task", "hellaswag", "--num-fewshot", "2"],
            "--num-fewshot is an option of capability evaluation",
        ),
        (["--limit", "5"], "--limit counts examples of hellaswag or --tasks"),  # not of the val loss
    ]
    for extra, message in cases:
        assert main(["eval", str(run), *extra]) == 2
        assert message in capsys.readouterr().err
    out = tmp_path / "new" / "deeper" / "e.json"
    argv = ["eval", str(run), "--tasks", "evkit_mc", "--include-path", str(tasks), "--json", str(out)]
    assert main([*argv, "--num-fewshot", "9"]) == 2  # refused once the tasks are read: no model was
    assert "--num-fewshot 9: task 'evkit_mc' has 6 document(s)" in capsys.readouterr().err
    assert out.parent.is_dir() and not out.exists()


def test_cli_refuses_bad_combinations_before_any_model(kit, tmp_path, capsys):
    assert main(["eval", str(kit.run), "--suite", "core"]) == 2
    assert "--suite core needs --bundle" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--tasks", "evkit_mc", "--include-path", str(kit.tasks)]) == 2
    assert "not a loom run" in capsys.readouterr().err
    assert main(["train", f"--data.path={kit.data}", "--eval.every=5"]) == 2
    assert "eval.every=5 has nothing to score" in capsys.readouterr().err
