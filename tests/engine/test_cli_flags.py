"""The CLI generated from the models: a flag per MoEConfig field with its choices and help, the
assumed platform said on stderr, --detect exclusive with --platform, --version, quiet pipes,
config-file errors at file:line:col with a did-you-mean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moerules import __version__
from moerules.config import MoEConfig
from moerules.tools.cli.main import main, make_parser
from moerules.tools.cli.flags import ALIASES, _kind, flag_sections

ROOT = Path(__file__).resolve().parents[2]


def _fields():
    return [(section, name, field) for section, info in MoEConfig.model_fields.items()
            for name, field in info.annotation.model_fields.items()]


def _sample(field) -> tuple[list[str], object]:
    """Command-line words for a non-default value of the field, and the value the sections get."""
    kind, choices = _kind(field.annotation)
    if kind is bool:
        return [] if field.default is not True else ["--no"], field.default is not True
    if kind is frozenset:
        return [",".join(choices[-2:])], choices[-2:]
    if choices:
        return [choices[-1]], choices[-1]
    return {int: (["3"], 3), float: (["2.5"], 2.5), str: (["x1"], "x1")}[kind]


def _explain_parser():
    return make_parser()._subparsers._group_actions[0].choices["explain"]


@pytest.mark.parametrize("section,name,field", _fields(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_config_field_is_a_flag_with_help(section, name, field):
    parser = _explain_parser()
    [action] = [a for a in parser._actions if a.dest == f"config__{section}__{name}"]
    name_given = next(n for n in action.option_strings if not n.startswith("--no-"))
    assert action.help and len(action.help) > 10, f"{section}.{name}: give the Field a description"
    words, value = _sample(field)
    if words[:1] == ["--no"]:
        argv, value = ["--no-" + name_given[2:]], False
    elif field.annotation is bool:
        argv = [name_given]
    else:
        argv = [name_given, *words]
    args = parser.parse_args(argv)
    assert flag_sections(args, args.config_flags) == {section: {name: value}}


def test_closed_fields_list_their_choices_and_refuse_others_with_a_suggestion(capsys):
    help_text = " ".join(_explain_parser().format_help().split())
    assert "one of: unquantized, fp8_w8a8" in help_text and "--family FAMILY, --quant FAMILY" in help_text
    with pytest.raises(SystemExit) as raised:
        main(["decide", "--model", "mixtral-8x7b", "--quant", "fp8_w8a"])
    assert raised.value.code == 2
    assert "argument --family/--quant: 'fp8_w8a' is not one of: unquantized" in capsys.readouterr().err


def test_the_old_spellings_are_aliases():
    assert {names[0] for names in ALIASES.values()} == {"--quant", "--ep", "--all2all"}
    args = _explain_parser().parse_args(["--ep", "--all2all", "torch_all2all", "--tp", "2", "--packages", "triton,aiter"])
    assert flag_sections(args, args.config_flags) == {
        "parallel": {"expert_parallel": True, "all2all_backend": "torch_all2all", "tp": 2},
        "platform": {"packages": ["triton", "aiter"]}}


def test_a_layer_from_flags_alone_and_a_flag_error_names_the_flag(capsys):
    sizes = ["--num-experts", "8", "--top-k", "2", "--hidden-size", "64", "--moe-intermediate-size", "64"]
    assert main(["decide", *sizes, "--platform", "cpu:x86_64"]) == 0
    assert main(["decide", *sizes, "--platform", "cpu:x86_64", "--hidden-size", "0"]) == 2
    assert capsys.readouterr().err == "moerules: --hidden-size: Input should be greater than or equal to 1\n"


def test_no_platform_says_which_one_is_assumed(capsys):
    assert main(["decide", "--model", "mixtral-8x7b"]) == 0
    assert capsys.readouterr().err == ("moerules: no platform given; deciding for cuda:sm_90 with packages triton "
                                       "(give --platform VENDOR:ARCH, or --detect for this machine)\n")
    assert main(["decide", "--model", "mixtral-8x7b", "--platform", "cuda:sm_90"]) == 0
    assert capsys.readouterr().err == ""


def test_detect_is_exclusive_with_the_platform(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["decide", "--model", "mixtral-8x7b", "--detect", "--platform", "cuda:sm_90"])
    assert raised.value.code == 2
    assert "argument --platform: not allowed with argument --detect" in capsys.readouterr().err
    assert main(["decide", "--model", "mixtral-8x7b", "--detect", "--arch", "sm_80"]) == 2
    assert capsys.readouterr().err == "moerules: --detect takes the platform from this machine; drop --arch, or " \
                                      "drop --detect\n"


def test_version(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["--version"])
    assert raised.value.code == 0 and capsys.readouterr().out == f"moerules {__version__}\n"


def test_a_closed_pipe_is_quiet():
    # `head -n 0` exits before moerules (starting up) writes: the write meets a closed pipe.
    command = f"{sys.executable} -m moerules.tools.cli.main decide --model mixtral-8x7b --platform cpu:x86_64 --json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for reader in ("head -n 0", "head -1"):
        done = subprocess.run(f"{command} 2>err.txt | {reader}; cat err.txt", shell=True, capture_output=True,
                              text=True, env=env, cwd=os.environ.get("TMPDIR", "/tmp"), timeout=120)
        assert done.stdout in ("", "{\n") and done.stderr == "", reader


def test_config_file_errors_point_at_file_line_col_with_a_suggestion(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: mixtral-8x7b\nparallel:\n  tpp: 2\n")
    assert main(["decide", str(bad)]) == 2
    assert capsys.readouterr().err == f"moerules: {bad}:3:3: unknown field 'tpp' (did you mean 'tp'?)\n"
    bad.write_text("model: mixtrl\n")
    assert main(["decide", str(bad)]) == 2
    assert f"{bad}:1:8: unknown model preset 'mixtrl' (did you mean 'mixtral-8x7b'?)" in capsys.readouterr().err


def test_a_stepwise_progress_line_names_each_stage():
    import io
    from moerules.tools.progress import Progress
    stream = io.StringIO()
    bar = Progress(2, "run", stream)
    bar.stage("importing torch")
    bar.stage("building")
    bar.close()
    assert stream.getvalue() == "\rrun: 1/2 importing torch \rrun: 2/2 building        \rrun: 2/2 building \n"
