"""The README is a user's manual whose every command works: at most 300 lines, and every command of
its fenced ``bash`` blocks checked here.

- ``streamflow run|launch|store serve``: run for real with ``--dry-run`` (appended when the README
  starts a real run), in a scratch directory holding what the README tells the user to write
  (its ``# NAME`` YAML and Python blocks, the prompt file) and stand-ins for what a user brings
  (a model directory). Exit 0 and no warning, or exactly the ``error:`` lines the ``text`` block
  right after shows, one per command.
- ``streamflow config keys``: run; ``streamflow`` subcommands that need a finished run
  (``report``): parsed by the CLI's own parser; ``python -m MODULE``: its ``--help`` names every
  flag used.
- What a unit test cannot run (``make demo``, ``make test``, ``docker compose``, a GPU box, a
  Prometheus server) is listed in ``ELSEWHERE`` with the test or Makefile target that runs it,
  and that test or target must exist.
A command of any other kind fails the test: add it to one of these lists. Every link of the
README reaches its file, and its heading when it names one.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 300
LANGS = {"bash", "yaml", "python", "jsonl", "text"}
# command prefix -> where it runs for real: "tests/FILE.py::test_name" or "Makefile:target"
ELSEWHERE = {
    "make demo": "tests/bench/test_bench_learn.py::"
                 "test_a_shortened_demo_recipe_raises_the_training_reward",
    "make test": "Makefile:test",
    "make gpu-smollm2": "tests/workers/test_gpu.py::test_periodic_smollm2_run_on_one_gpu",
    "make gpu-check": "tests/bench/test_bench_gpu.py::"
                      "test_smoke_check_runs_every_step_on_the_cpu_and_writes_one_json",
    "docker compose": "Makefile:compose-test",
    # a Ray cluster and a Slurm allocation, made by these tests (docs/multihost.md)
    "streamflow launch job.yaml --backend ray": "tests/streamflow/test_launch_ray.py::"
                                                "test_ray_two_nodes_equal_one_host_through_a_node_kill",
    "sbatch": "tests/streamflow/test_launch_slurm.py::"
              "test_sbatch_runs_over_two_nodes_and_a_requeued_job_resumes",
    "prometheus": "tests/streamflow/test_prometheus.py::"
                  "test_every_dashboard_panel_returns_data_from_a_real_run",
}
# streamflow subcommands run for real (with --dry-run where they take it)
DRY_RUN = {("run",), ("launch",), ("store", "serve")}
RUN_AS_IS = {("config", "keys")}
# what a user brings, or `make gpu-smollm2` writes: stand-ins the checks before a run accept
MODEL_DIRS = ("models/my-model", "runs/models/SmolLM2-135M-Instruct")
PROMPT_FILES = ("prompts.jsonl", "runs/data/word_problems.jsonl")
# what `streamflow model train-reward` writes (its own test runs it: tests/workers/test_reward_model.py)
REWARD_MODEL_DIRS = ("runs/reward-model",)


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based


@dataclass(frozen=True)
class Command:
    text: str  # as written (comment stripped)
    line: int
    expected_error: str | None  # the `error:` line the README shows for it, if any
    expected_output: tuple[str, ...] = ()  # lines the README shows of its output, in order


def fenced_blocks(markdown: str) -> list[Block]:
    blocks, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            blocks.append(Block(lang, "\n".join(lines[start + 1:i]), start + 1))
        i += 1
    return blocks


def readme_commands(markdown: str) -> list[Command]:
    blocks, out = fenced_blocks(markdown), []
    for n, block in enumerate(blocks):
        if block.lang != "bash":
            continue
        texts = [" ".join(shlex.split(line, comments=True)) for line in block.text.splitlines()]
        texts = [t for t in texts if t]
        after = blocks[n + 1] if n + 1 < len(blocks) else None
        errors = after.text.splitlines() if after and after.lang == "text" else []
        shown = [e for e in errors if e != "..."]
        errors = [e for e in errors if e.startswith("error:")]
        if errors:
            assert len(errors) == len(texts), f"README line {block.line}: one error line per command"
        elif shown:  # an excerpt of the output of the block's one command
            assert len(texts) == 1, f"README line {block.line}: output shown for several commands"
            out.append(Command(texts[0], block.line, None, tuple(shown)))
            continue
        out += [Command(t, block.line, errors[k] if errors else None) for k, t in enumerate(texts)]
    return out


def readme_files(markdown: str) -> dict[str, str]:
    """The files the README has the user write: a YAML or Python block whose first line is
    ``# NAME``, and the prompt file (its ``jsonl`` block)."""
    files = {}
    for block in fenced_blocks(markdown):
        first = block.text.splitlines()[0] if block.text else ""
        if block.lang in ("yaml", "python") and re.fullmatch(r"# [\w.-]+\.(yaml|py)", first):
            files[first[2:]] = block.text + "\n"
        elif block.lang == "jsonl":
            files["prompts.jsonl"] = block.text + "\n"
    return files


MARKDOWN = README.read_text()
COMMANDS = readme_commands(MARKDOWN)


def test_the_readme_is_a_manual_of_at_most_300_lines():
    assert len(MARKDOWN.splitlines()) <= MAX_LINES


def test_every_fenced_block_says_what_it_holds():
    # an unlabelled block could hide a command from the checks below
    assert [(b.line, b.lang) for b in fenced_blocks(MARKDOWN) if b.lang not in LANGS] == []


def test_the_readme_has_the_commands_a_user_starts_with():
    texts = [c.text for c in COMMANDS]
    assert "make demo" in texts and "make test" in texts
    assert any(t.startswith("streamflow launch") for t in texts)
    assert any(t.startswith("streamflow run") and t.endswith("--dry-run") for t in texts)


def test_the_readme_reward_scores_the_readme_prompts(tmp_path, monkeypatch):
    files = readme_files(MARKDOWN)
    (tmp_path / "my_reward.py").write_text(files["my_reward.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget_readme_modules(monkeypatch)
    from workers.tasks.verifiers import resolve_reward

    score = resolve_reward("my_reward:score")  # as reward.fn names it
    rows = [json.loads(line) for line in files["prompts.jsonl"].splitlines()]
    assert rows and all(set(r) == {"prompt", "answer"} for r in rows)
    for row in rows:
        assert score(f"The answer is {row['answer']}.", row["answer"]) == 1.0
        assert score(f"The answer is {int(row['answer']) + 1}.", row["answer"]) == 0.0
        assert score("I do not know.", row["answer"]) == 0.0


def test_the_readme_environment_answers_the_readme_call(tmp_path, monkeypatch):
    files = readme_files(MARKDOWN)
    (tmp_path / "my_env.py").write_text(files["my_env.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget_readme_modules(monkeypatch)
    from workers.agent.environments import StepContext, execute, load_environment

    env = load_environment("my_env:GuessEnv")  # as env.fn names it in tools.yaml
    assert "fn: my_env:GuessEnv" in files["tools.yaml"]
    call = re.search(r"`(<tool_call>.*?</tool_call>)`", MARKDOWN).group(1)  # the README's call
    answers = {target: execute(env, call, StepContext("guess", str(target), 0))
               for target in (3, 7, 9)}
    assert [(o.text, o.error, o.done) for o in answers.values()] == [
        ("lower", None, False), ("correct", None, True), ("higher", None, False)]


def test_the_readme_agent_is_one_the_run_can_call(tmp_path, monkeypatch):
    """my_agent.py takes what agent workers hand it (the dry run's own check), and the section's
    config line names it so."""
    from streamflow.preflight import _check_agent

    files = readme_files(MARKDOWN)
    (tmp_path / "my_agent.py").write_text(files["my_agent.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget_readme_modules(monkeypatch)
    _check_agent("my_agent:run")
    assert "`agent: {fn: my_agent:run}`" in MARKDOWN


def _forget_readme_modules(monkeypatch) -> None:
    """Each test imports the README's modules from its own directory, never an earlier one's."""
    for name in readme_files(MARKDOWN):
        if name.endswith(".py"):
            monkeypatch.delitem(sys.modules, name.removesuffix(".py"), raising=False)


def _where_it_runs_exists(where: str) -> bool:
    if where.startswith("Makefile:"):
        target = where.removeprefix("Makefile:")
        return re.search(rf"^{re.escape(target)}:", (REPO / "Makefile").read_text(), re.M) is not None
    path, _, name = where.partition("::")
    return (REPO / path).is_file() and f"def {name}(" in (REPO / path).read_text()


def _scratch(tmp_path: Path) -> Path:
    """A directory laid out as the user's: the repository's configs, the README's files, and
    stand-ins for a model directory and prompt files with enough distinct prompts to hold out."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    for name, text in readme_files(MARKDOWN).items():
        (tmp_path / name).write_text(text)
    for rel in MODEL_DIRS:
        model = tmp_path / rel
        model.mkdir(parents=True)
        for name in ("config.json", "tokenizer.json"):
            (model / name).write_text("{}")
        (model / "model.safetensors").write_bytes(b"")
    for rel in REWARD_MODEL_DIRS:  # a one-logit sequence classifier, as the checks read it
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "config.json").write_text(json.dumps(
            {"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}))
        (tmp_path / rel / "model.safetensors").write_bytes(b"")
    rows = "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                   for i in range(200))
    for rel in PROMPT_FILES:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((path.read_text() if path.exists() else "") + rows)
    return tmp_path


def _split_env(words: list[str], cwd: Path) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value.replace("$PWD", str(cwd))
    return env, words


def _names_flag(helptext: str, word: str) -> bool:
    flag = word.split("=")[0]  # whole: --dev is not --device
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helptext) is not None


def _check_streamflow(argv: list[str], command: Command, capsys) -> None:
    from streamflow import cli

    sub = tuple(argv[:2]) if argv[0] in ("store", "config") else (argv[0],)
    if sub in DRY_RUN or sub in RUN_AS_IS:
        if sub in DRY_RUN and "--dry-run" not in argv:
            argv = [*argv, "--dry-run"]
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        if command.expected_error is not None:  # shown whole, or cut short with "..."
            shown, line = command.expected_error, err.strip().splitlines()[-1] if err else ""
            assert rc == 2, err
            assert line.startswith(shown[:-3]) if shown.endswith("...") else line == shown, err
        else:
            assert rc == 0, err
            assert "warning:" not in err, err
            lines = iter(out.splitlines())  # the excerpt's lines, in order (`in` consumes)
            assert all(line in lines for line in command.expected_output), out
        if sub == ("config", "keys"):
            from streamflow.config.keys import render

            assert out == render()
        return
    if sub == ("bench",):  # the benchmark exists and takes every flag given
        assert argv[1] in cli.available_benches(), argv[1]
        module = importlib.import_module(f"bench.{argv[1]}")
        with pytest.raises(SystemExit):
            module.main(["--help"])
        helptext = capsys.readouterr().out
        assert all(_names_flag(helptext, a) for a in argv[2:] if a.startswith("--")), argv
        return
    args, extra = cli._build_parser().parse_known_args(argv)  # exits (2) on a usage error
    assert extra == [] and args.command == argv[0]


def _check_python_module(words: list[str]) -> None:
    assert words[:2] == ["python", "-m"], words
    proc = subprocess.run([sys.executable, "-m", words[2], "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all(_names_flag(proc.stdout, w) for w in words[3:] if w.startswith("--")), words


def _check_paths_exist(words: list[str], cwd: Path) -> None:
    for word in words:
        value = word.split("=", 1)[-1]
        if re.fullmatch(r"(?!/)[\w./-]+\.(ya?ml|py|sh|json)", value):
            assert (REPO / value).exists() or (cwd / value).exists(), f"{value} does not exist"


@pytest.mark.parametrize("command", COMMANDS, ids=[c.text[:70] for c in COMMANDS])
def test_every_readme_command_runs_or_parses(command, tmp_path, monkeypatch, capsys):
    cwd = _scratch(tmp_path)
    monkeypatch.chdir(cwd)
    _forget_readme_modules(monkeypatch)
    env, words = _split_env(shlex.split(command.text), cwd)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
        if key == "PYTHONPATH":  # the in-process checks import as the run would
            monkeypatch.syspath_prepend(value)
    _check_paths_exist(words, cwd)
    elsewhere = [where for prefix, where in ELSEWHERE.items()
                 if command.text == prefix or command.text.startswith(prefix + " ")]
    if elsewhere:
        assert _where_it_runs_exists(elsewhere[0]), elsewhere[0]
        if words[0] == "make":  # the target is the Makefile's
            assert _where_it_runs_exists(f"Makefile:{words[1]}"), words[1]
        return
    if words[0] == "streamflow":
        _check_streamflow(words[1:], command, capsys)
    elif words[0] == "python":
        _check_python_module(words)
    else:
        pytest.fail(f"README line {command.line}: {command.text!r} is checked nowhere: run it "
                    "here, or name in ELSEWHERE the test that runs it")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_readme_reaches_its_file_and_heading():
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", MARKDOWN):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = REPO / path
        if not file.is_file():
            broken.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert broken == []
