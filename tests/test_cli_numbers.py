"""Every number flag of every shipped command line refuses a bad value when it is parsed: one
"error:" line naming the flag, exit status 2, never a silent default.

The flags are read from the parsers themselves (their ``type=``), so a new number flag is covered
as soon as it is added; a flag typed with bare ``int``/``float`` (which takes 0, negatives, NaN
and inf) or with a checker this file does not know fails ``test_every_typed_flag_is_checked``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tempo.utils import NumberArg, int_in, number_in, positive_int, positive_int_or_unset, positive_size, proportion

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> dict[str, tuple[argparse.ArgumentParser, list[str], argparse.ArgumentParser]]:
    """Each shipped command: (the parser its command line goes through, the argv prefix that satisfies
    its required arguments, the parser that holds its flags: a tempo.bench subcommand's own)."""
    from tempo.bench.__main__ import build_parser as bench_parser
    from tempo.memory import cli as memory
    from tempo.movement import cli as movement
    from tempo.plan import cli as plan
    from tempo.tasks import demo, pretrain, squad

    commands = {name: (parser, prefix, parser) for name, parser, prefix in (
        ("python -m tempo.plan", plan._parser(), []),
        ("python -m tempo.memory", memory.build_parser(), []),
        ("python -m tempo", demo.build_parser(), []),
        ("python -m tempo.movement", movement.build_parser(), []),
        ("run_pretraining.py", pretrain.build_parser(), ["--config_file", "c.json", "--output_dir", "out"]),
        ("run_squad.py", squad.build_parser(), ["--output_dir", "out"]),
    )}
    bench = bench_parser()
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        commands[f"python -m tempo.bench {name}"] = (bench, [name] + (["results"] if name == "report" else []), parser)
    return commands


def _actions(command: str) -> list[argparse.Action]:
    """The command's flags that convert their value (``type=``)."""
    return [a for a in COMMANDS[command][2]._actions if a.option_strings and a.type is not None]


COMMANDS = _commands()


def _custom_checkers() -> dict:
    """Number checkers other than NumberArg: (bad values, a good value) each."""
    from tempo.bench.gpu_suite import parse_parts
    from tempo.bench.layer_bench import _parse_shape
    from tempo.memory.cli import MAX_FAMILY_SEQ_LEN, _seq_len
    from tempo.bench.ops_bench import _bytes_arg
    from tempo.train.flags import max_tokens_flag

    return {
        positive_size: (["0", "-1", "0.5", "lots", "nan"], "2GiB"),
        max_tokens_flag: (["0", "-1", "1.5", "lots"], "8192"),
        _seq_len: (["0", "-1", str(MAX_FAMILY_SEQ_LEN + 1), "long"], "16"),
        _parse_shape: (["0x512", "8x0", "-1x512", "8x", "big"], "8x512"),
        _bytes_arg: (["-1", "nan", "lots"], "0"),
        parse_parts: (["0", "-1", "4", "all"], "1"),
    }


CUSTOM = _custom_checkers()
UNBOUNDED = {"--null_score_diff_threshold"}  # a score threshold: any finite number, negatives included


def _fmt(value: float, integer: bool) -> str:
    return str(int(value)) if integer else repr(float(value))


def bad_values(t: NumberArg) -> list[str]:
    """Values ``t`` must refuse, from its bounds: below and above them, non-numbers, NaN and inf."""
    out = ["abc", "1.5" if t.integer else "nan"] + ([] if t.integer else ["inf", "-inf"])
    if t.low is not None:
        below = ([v for v in (t.low - 1, t.low - 2, t.low - 3) if v != t.sentinel][:2] if t.integer
                 else ([t.low] if t.low_open else []) + [t.low - 0.5])
        out += [_fmt(v, t.integer) for v in below]
    if t.high is not None:
        out.append(_fmt(t.high if t.high_open else t.high + 1, t.integer))
    return out


def good_values(t: NumberArg) -> list[str]:
    """Values ``t`` must take: its lowest (or just above an open low end), one more inside, the sentinel."""
    if t.low is None:
        return ["-1.5", "0", "2.5"]
    first = t.low + (0.25 if t.low_open else 0)
    second = first + 1 if t.high is None else (t.low + t.high) / 2
    return [_fmt(first, t.integer), _fmt(second, t.integer)] + ([] if t.sentinel is None else [str(t.sentinel)])


def _cases(kind: str) -> list:
    cases = []
    for command in COMMANDS:
        for action in _actions(command):
            flag = action.option_strings[0]
            if isinstance(action.type, NumberArg):
                values = bad_values(action.type) if kind == "bad" else good_values(action.type)
            elif action.type in CUSTOM:
                values = CUSTOM[action.type][0] if kind == "bad" else [CUSTOM[action.type][1]]
            else:
                continue
            cases += [pytest.param(command, flag, v, id=f"{command}:{flag}={v}") for v in values]
    return cases


def _action(command: str, flag: str) -> argparse.Action:
    return next(a for a in _actions(command) if flag in a.option_strings)


def _argv(command: str, flag: str, value: str) -> list[str]:
    nargs = _action(command, flag).nargs
    return COMMANDS[command][1] + [flag] + [value] * (nargs if isinstance(nargs, int) else 1)


def unchecked(where: str, action: argparse.Action) -> list[str]:
    """What is wrong with one typed flag: bare int/float, a type that is neither a NumberArg, a known
    checker nor text, or a NumberArg without a lower bound of at least -1 (DLE's "not set")."""
    if action.type in (int, float):
        return [f"{where}: bare {action.type.__name__}; use tempo.utils' number types"]
    if not (action.type is str or isinstance(action.type, NumberArg) or action.type in CUSTOM):
        return [f"{where}: type {action.type!r} is not a NumberArg; add it to CUSTOM with its bad values"]
    if isinstance(action.type, NumberArg) and action.option_strings[0] not in UNBOUNDED and not (
            action.type.low is not None and action.type.low >= -1):
        return [f"{where}: no lower bound"]
    return []


def test_every_typed_flag_is_checked():
    problems = [p for command in COMMANDS for a in _actions(command)
                for p in unchecked(f"{command} {a.option_strings[0]}", a)]
    assert problems == []
    numbers = sum(isinstance(a.type, NumberArg) for command in COMMANDS for a in _actions(command))
    assert numbers >= 100  # the walk reached the parsers' flags (115 when written)


def test_the_flag_check_trips_on_bare_and_unknown_types():
    parser = argparse.ArgumentParser()
    actions = [parser.add_argument("--n", type=int), parser.add_argument("--x", type=float),
               parser.add_argument("--f", type=lambda text: text), parser.add_argument("--s", type=number_in()),
               parser.add_argument("--ok", type=positive_int)]
    said = [p for a in actions for p in unchecked("cmd", a)]
    assert [p.split(";")[0] for p in said] == [
        "cmd: bare int", "cmd: bare float", f"cmd: type {actions[2].type!r} is not a NumberArg", "cmd: no lower bound"]


@pytest.mark.parametrize("command, flag, value", _cases("bad"))
def test_a_bad_number_is_refused_with_one_line_naming_the_flag(command, flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        COMMANDS[command][0].parse_args(_argv(command, flag, value))
    assert exc.value.code == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {flag}" in errors[0], captured.err
    assert captured.out == ""


@pytest.mark.parametrize("command, flag, value", _cases("good"))
def test_a_good_number_still_parses(command, flag, value):
    action = _action(command, flag)
    parsed = getattr(COMMANDS[command][0].parse_args(_argv(command, flag, value)), action.dest)
    expected = action.type(value)
    if isinstance(action.nargs, int):
        expected = [expected] * action.nargs
    elif action.nargs == "+" or isinstance(action, argparse._AppendAction):
        expected = [expected]
    assert parsed == expected


def test_the_messages_say_what_is_wanted():
    def message(t, text):
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            t(text)
        return str(exc.value)

    assert message(positive_int, "0") == "must be a positive integer, got 0"
    assert message(positive_int, "x") == "must be a positive integer, got 'x'"
    assert message(int_in(-1), "-2") == "must be an integer >= -1, got -2"
    assert message(positive_int_or_unset, "0") == "must be a positive integer or -1, got 0"
    assert message(proportion, "1") == "must be a finite number >= 0 and < 1, got 1"
    assert message(number_in(0.0, low_open=True), "nan") == "must be a finite number > 0, got nan"
    assert message(positive_size, "0MiB") == "must be a positive size (e.g. 2GiB, 512MB), got '0MiB'"
    assert positive_int_or_unset("-1") == -1 and positive_size("2KiB") == 2048
    assert isinstance(positive_int("7"), int) and isinstance(proportion("0"), float)


def test_plan_cli_does_not_replace_a_bad_length_by_its_default():
    """The reported bug: ``python -m tempo.plan --seq-len 0`` planned at 512 and exited 0."""
    proc = subprocess.run([sys.executable, "-m", "tempo.plan", "--seq-len", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["python -m tempo.plan: error: argument --seq-len: must be a positive integer, got 0"], proc.stderr
