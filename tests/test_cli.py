"""The command line, run as a user would: `python -m autopipe plan|verify file.py:factory ...` in a subprocess."""
from __future__ import annotations

import ast
import os
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.out(y)
            return x + self.proj(F.gelu(self.fc(self.ln2(x))))


    class GPT(nn.Module):
        def __init__(self, layers=4, d=32, heads=4, vocab=100, seq=16):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))


    def gpt(layers=4, d=32):
        return GPT(layers=layers, d=d)


    class CNN(nn.Module):
        def __init__(self, c=8, classes=10):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
            self.body = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
                                      for _ in range(4))
            self.fc = nn.Linear(c, classes)

        def forward(self, x):
            x = self.stem(x)
            for layer in self.body:
                x = x + layer(x)
            return self.fc(x.mean(dim=(2, 3)))


    def cnn():
        return CNN()


    class Annealed(nn.Module):
        """Scales a branch by its call count, a Python int: tracing freezes it, so the pipeline differs."""

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return torch.tanh(self.a(x)) + self.b(x) * (1 + 0.1 * self.calls)


    def annealed():
        return Annealed()


    NOT_A_FACTORY = 3
''')


@pytest.fixture(scope="module")
def factory_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "models.py"
    path.write_text(FACTORIES)
    return path


def autopipe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "autopipe", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd or ROOT, env=env)


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """The same command through the CLI's main() in this process: the checks of bad input, where a new interpreter per
    case spent ~3 s starting (the subprocess tests above and below run it as a user does)."""
    from autopipe.__main__ import main
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_plan_gpt_on_meta_writes_valid_stage_files(factory_file, tmp_path):
    out = tmp_path / "stages"
    r = autopipe("plan", f"{factory_file}:gpt", "--input-shape", "4,16", "--input-dtype", "long",
                 "--devices", "3", "--chunks", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "Plan: 3 stages x 4 micro-batches" in r.stdout
    assert "cut 0|1" in r.stdout and "cut 1|2" in r.stdout
    for name in ("trace", "cost", "partition", "codegen"):  # each pass reports its seconds on stderr
        assert any(line.startswith(f"autopipe: {name}") and line.rstrip().split()[2].replace(".", "").isdigit()
                   for line in r.stderr.splitlines()), r.stderr
    assert "on meta" in r.stderr
    files = sorted(out.glob("stage_*.py"))
    assert [f.name for f in files] == ["stage_0.py", "stage_1.py", "stage_2.py"]
    for f in files:
        source = f.read_text()
        tree = ast.parse(source, filename=str(f))  # valid Python
        assert any(isinstance(n, ast.FunctionDef) and n.name == "forward" for n in tree.body), source
        compile(source, str(f), "exec")
        assert f"# autopipe stage {f.stem[-1]} of 3" in source
        assert str(f) in r.stdout


def test_plan_cnn_and_balance_by_params(factory_file, capsys):
    r = in_process(capsys, "plan", f"{factory_file}:cnn", "--input-shape", "8,3,32,32", "--devices", "2", "--chunks", "4",
                 "--balance", "params")
    assert r.returncode == 0, r.stderr
    assert "Plan: 2 stages x 4 micro-batches, balanced by params" in r.stdout
    assert "codegen" not in r.stderr  # no --out: nothing generated, nothing written


@pytest.mark.parametrize("balance", ["time", "train_time"])
def test_plan_cnn_for_real_balanced_by_time(factory_file, tmp_path, capsys, balance):
    r = in_process(capsys, "plan", f"{factory_file}:cnn", "--input-shape", "8,3,16,16", "--devices", "2", "--chunks", "2",
                 "--no-meta", "--balance", balance, "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"balanced by {balance}" in r.stdout and "on cpu" in r.stderr
    assert len(list(tmp_path.glob("stage_*.py"))) == 2


def test_a_huge_model_plans_on_meta_without_memory(factory_file):
    # 24 blocks at d=4096: 4.8 B parameters, 19 GB of fp32 weights if they were real
    r = autopipe("plan", f"{factory_file}:gpt", "--factory-arg", "layers=24", "--factory-arg", "d=4096",
                 "--input-shape", "8,16", "--input-dtype", "long", "--devices", "8", "--chunks", "32")
    assert r.returncode == 0, r.stderr
    assert "Plan: 8 stages x 32 micro-batches" in r.stdout
    millions = float(re.search(r"\(([\d,.]+) M parameters\)", r.stderr).group(1).replace(",", ""))
    assert millions > 4000, r.stderr
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far, in KiB on Linux
    assert peak_kib < 4 * 2**20, f"a child process peaked at {peak_kib / 2**20:.1f} GiB"


def test_help_explains_itself_with_an_example(capsys):
    r = autopipe("--help")
    assert r.returncode == 0
    assert "plan" in r.stdout and "verify" in r.stdout and "example" in r.stdout
    r = in_process(capsys, "plan", "--help")
    assert r.returncode == 0
    for flag in ("--input-shape", "--input-dtype", "--kwarg-shape", "--devices", "--chunks", "--balance", "--out",
                 "--meta", "--no-meta"):
        assert flag in r.stdout
    assert "example" in r.stdout and "python -m autopipe plan" in r.stdout
    r = in_process(capsys)
    assert r.returncode == 2 and "plan" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["plan", "{dir}/missing.py:gpt", "--input-shape", "4,16"], "no such file: {dir}/missing.py"),
    (["plan", "{file}:transformer", "--input-shape", "4,16"], "has no 'transformer' (it defines: "),
    (["plan", "{file}:NOT_A_FACTORY", "--input-shape", "4,16"], "not a function or class"),
    (["plan", "{file}", "--input-shape", "4,16"], "expected FILE.py:FACTORY"),
    (["plan", "{file}:gpt", "--input-shape", "4,x"], "--input-shape '4,x' is not a shape"),
    (["plan", "{file}:gpt", "--input-shape", "4,-2"], "is not a shape"),
    (["plan", "{file}:gpt", "--input-shape", "4,16", "--input-dtype", "lng"], "'lng' is not a torch dtype"),
    (["plan", "{file}:gpt", "--kwarg-shape", "idx"], "expected NAME=VALUE"),
    (["plan", "{file}:gpt", "--input-shape", "4,16", "--chunks", "many"], "invalid int value"),
    (["plan", "{file}:gpt"], "give the example input's shape"),
    (["plan", "{file}:gpt", "--input-shape", "4,16", "--balance", "train_time"],
     "--balance train_time runs the model to time it: add --no-meta"),
    (["plan", "{file}:gpt", "--input-shape", "4,16", "--balance", "speed"], "'speed': use flops, train_flops, params"),
])
def test_bad_input_is_one_clear_line_and_exit_code_2(factory_file, args, message, capsys):
    fill = {"file": str(factory_file), "dir": str(factory_file.parent)}
    r = in_process(capsys, *(a.format(**fill) for a in args))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert message.format(**fill) in lines[0]
    assert r.stdout == ""


def _fake_embedding_rejects_float_indices() -> bool:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        try:
            torch.nn.functional.embedding(torch.zeros(4, 16), torch.zeros(100, 8))
        except RuntimeError:
            return True
    return False


def test_a_failing_trace_names_the_node_and_hints_without_a_traceback(factory_file):
    if not _fake_embedding_rejects_float_indices():
        pytest.skip("this torch's fake embedding kernel takes float indices: the plan on meta cannot tell")
    r = autopipe("plan", f"{factory_file}:gpt", "--input-shape", "4,16")  # token ids given as float32
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "wte" in r.stderr and "--input-dtype long" in r.stderr


# -- verify ---------------------------------------------------------------------------------

def test_verify_a_gpt_passes_with_a_per_parameter_table(factory_file):
    r = autopipe("verify", f"{factory_file}:gpt", "--factory-arg", "layers=2", "--input-shape", "8,16",
                 "--input-dtype", "long", "--int-high", "100", "--devices", "2", "--chunks", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "autopipe.verify: GPT in train mode" in r.stdout
    assert "[structure] PASS (tolerance 1e-10)" in r.stdout and "[replay] PASS (tolerance 0: bit for bit)" in r.stdout
    assert "max|Δ|/max|ref|" in r.stdout and "blocks.0." in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("PASS: ")
    assert "on cpu" in r.stderr and "verified in" in r.stderr


def test_verify_a_cnn_in_eval_mode_with_every_micro_batch_rematerialised(factory_file, capsys):
    r = in_process(capsys, "verify", f"{factory_file}:cnn", "--input-shape", "8,3,8,8", "--mode", "eval",
                 "--checkpoint", "always", "--devices", "cpu,cpu,cpu", "--chunks", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "in eval mode" in r.stdout and "3 stages" in r.stdout and "checkpoint='always'" in r.stdout


def test_verify_fails_with_exit_code_1_and_names_the_parameter(factory_file, capsys):
    r = in_process(capsys, "verify", f"{factory_file}:annealed", "--input-shape", "8,8")
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.rstrip().splitlines()[-1]
    assert last.startswith("FAIL: structure") and "b.weight" in last
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["verify", "{file}:gpt"], "give the example input's shape"),
    (["verify", "{file}:gpt", "--input-shape", "8,16", "--devices", "0"], "--devices 0: at least 1"),
    (["verify", "{file}:gpt", "--input-shape", "8,16", "--devices", "tpu,tpu"], "--devices 'tpu,tpu'"),
])
def test_verify_bad_input_is_one_clear_line_and_exit_code_2(factory_file, args, message, capsys):
    fill = {"file": str(factory_file)}
    r = in_process(capsys, *(a.format(**fill) for a in args))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert r.stdout == ""


def test_verify_help_explains_itself(capsys):
    r = in_process(capsys, "verify", "--help")
    assert r.returncode == 0
    for flag in ("--input-shape", "--devices", "--chunks", "--checkpoint", "--mode", "--int-high", "exit status"):
        assert flag in r.stdout
