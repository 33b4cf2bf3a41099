"""The cluster launchers (scripts/train-*.sh, launch_mnist.sh on scripts/launch_common.sh), run against fakes.

Fake ``torchrun``, ``srun``, ``ssh``, ``scontrol`` and ``nvidia-smi`` on a PATH of their own record their
arguments (the fake ssh also runs the remote command in a shell, as ssh would, so quoting is checked by a
real shell); nothing trains. The expected hyperparameters and flags are the HyLo paper's and the training
scripts' as issue 11 lists them, written out here.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
BASH = shutil.which("bash") or "/bin/bash"

# Every flag of scripts/train.py and scripts/train_segmentation.py a launcher may pass.
KNOWN_FLAGS = set(
    "--data-dir --log-dir --resume --dataset --model --optimizer --solver --batch-size --epochs --max-steps --lr"
    " --lr-schedule --lr-decay --milestone --warmup-epochs --momentum --weight-decay --label-smoothing --damping"
    " --target-damping --damping-decay-epochs --freq --compression-ratio --kl-clip --strategy --adaptive"
    " --checkpoint-freq --backend --seed --workers --profiling --grad-norm --rank-analysis --grad-error"
    " --enable-id --enable-is --sngd".split()
)


@dataclass(frozen=True)
class Recipe:
    """A launcher's training script, HyLo's per-GPU batch, its default log dir and its fixed flags."""

    script: str
    per_gpu: int
    log_dir: str
    flags: dict[str, str]
    absent: tuple[str, ...] = ()


RECIPES = {
    "train-resnet32-cifar10.sh": Recipe(
        "train.py",
        128,
        "runs/resnet32-cifar10",
        {
            "--dataset": "cifar10",
            "--model": "resnet32",
            "--epochs": "100",
            "--warmup-epochs": "5",
            "--milestone": "35 75 90",
            "--lr": "1.8",
            "--lr-decay": "0.3",
            "--damping": "1.5",
            "--target-damping": "0.1",
            "--damping-decay-epochs": "90",
            "--weight-decay": "0.00045",
            "--freq": "13",
            "--checkpoint-freq": "10",
            "--adaptive": "10 35 40",
        },
    ),
    "train-densenet-cifar100.sh": Recipe(
        "train.py",
        128,
        "runs/densenet-cifar100",
        {
            "--dataset": "cifar100",
            "--model": "densenet",
            "--epochs": "60",
            "--warmup-epochs": "0",
            "--milestone": "30 45",
            "--lr": "0.05",
            "--lr-decay": "0.1",
            "--damping": "0.2",
            "--target-damping": "0.2",
            "--damping-decay-epochs": "60",
            "--weight-decay": "0.001",
            "--freq": "100",
            "--checkpoint-freq": "10",
            "--adaptive": "0 60 60",
            "--compression-ratio": "1",
        },
    ),
    "train-resnet50-imagenet.sh": Recipe(
        "train.py",
        80,
        "runs/resnet50-imagenet",
        {
            "--dataset": "imagenet",
            "--model": "resnet50",
            "--epochs": "55",
            "--warmup-epochs": "5",
            "--milestone": "25 35 40 45 50",
            "--lr": "4",
            "--lr-decay": "0.1",
            "--damping": "4",
            "--target-damping": "0.04",
            "--damping-decay-epochs": "50",
            "--weight-decay": "0.000025",
            "--freq": "200",
            "--checkpoint-freq": "5",
            "--adaptive": "10 35 40",
            "--label-smoothing": "0.1",
        },
    ),
    "train-unet-lgg.sh": Recipe(
        "train_segmentation.py",
        16,
        "runs/unet-lgg",
        {
            "--dataset": "lgg",
            "--model": "unet",
            "--epochs": "50",
            "--warmup-epochs": "10",
            "--lr": "0.0008",
            "--lr-decay": "1",
            "--damping": "0.03",
            "--target-damping": "0.03",
            "--damping-decay-epochs": "100",
            "--weight-decay": "0.0001",
            "--freq": "200",
            "--checkpoint-freq": "10",
            "--adaptive": "10 50 100",
        },
        absent=("--milestone",),
    ),
    "train-3c1f-fashion-mnist.sh": Recipe(
        "train.py",
        128,
        "runs/3c1f-fashion-mnist",
        {
            "--dataset": "fashion-mnist",
            "--model": "3c1f",
            "--epochs": "10",
            "--warmup-epochs": "0",
            "--milestone": "30 45",
            "--lr": "0.003",
            "--lr-decay": "0.1",
            "--damping": "0.3",
            "--target-damping": "0.3",
            "--damping-decay-epochs": "10",
            "--weight-decay": "0.001",
            "--freq": "100",
            "--checkpoint-freq": "10",
            "--adaptive": "0 10 10",
            "--compression-ratio": "1",
        },
    ),
}
LAUNCHERS = sorted(RECIPES)

# A fake tool: append {"prog", "args", "cwd", "env"} to $FAKE_LOG, then act as the tool it stands for.
FAKE = """\
import json, os, subprocess, sys
prog = os.path.basename(sys.argv[0])
keep = ("HYLO_PRELOADED", "FAKE_SSH_HOST")
record = {"prog": prog, "args": sys.argv[1:], "cwd": os.getcwd(), "env": {k: os.environ[k] for k in keep if k in os.environ}}
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(record) + "\\n")
if prog == "nvidia-smi":
    gpus = os.environ.get("FAKE_GPUS", "0")
    if gpus == "fail":
        sys.exit(9)
    for i in range(int(gpus)):
        print(f"GPU {i}: Fake GPU (UUID: GPU-{i})")
elif prog == "scontrol":
    print("\\n".join(os.environ["FAKE_HOSTS"].split()))
elif prog == "ssh":
    host, command = sys.argv[1], " ".join(sys.argv[2:])
    if host in os.environ.get("FAKE_SSH_FAIL", "").split():
        sys.exit(3)
    env = dict(os.environ, FAKE_SSH_HOST=host)
    sys.exit(subprocess.run([BASH, "-c", command], cwd=os.environ["HOME"], env=env).returncode)
else:
    sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


@dataclass
class Calls:
    """What one launcher run did: its exit status and output, and the fakes' recorded calls in order."""

    returncode: int
    stdout: str
    stderr: str
    calls: list[dict[str, Any]]

    def of(self, prog: str) -> list[list[str]]:
        """The argument lists of every call to ``prog``."""
        return [c["args"] for c in self.calls if c["prog"] == prog]

    def one(self, prog: str) -> list[str]:
        """The arguments of the single call to ``prog``."""
        (args,) = self.of(prog)
        return args


class Cluster:
    """A PATH of fakes and a clean environment (no Slurm variables of the machine running the tests)."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.home = root / "home"
        self.cwd = root / "launch dir"
        self.log = root / "calls.jsonl"
        for d in (self.bin, self.home, self.cwd):
            d.mkdir()
        for tool in ("torchrun", "srun", "ssh", "scontrol", "nvidia-smi"):
            fake = self.bin / tool
            fake.write_text(f"#!{sys.executable} -IS\nBASH = {BASH!r}\n{FAKE}")
            fake.chmod(0o755)
        for tool in ("dirname", "grep"):  # the only outside commands the launchers use
            found = shutil.which(tool)
            assert found, tool
            (self.bin / tool).symlink_to(found)

    def remove(self, tool: str) -> None:
        """Take ``tool`` off the PATH."""
        (self.bin / tool).unlink()

    def run(self, launcher: str, *args: str, **env: str) -> Calls:
        """Run ``bash scripts/<launcher> args`` from ``self.cwd`` with the fakes and ``env`` only."""
        if self.log.exists():
            self.log.unlink()
        base = {"PATH": str(self.bin), "HOME": str(self.home), "FAKE_LOG": str(self.log), "FAKE_GPUS": "4"}
        done = subprocess.run(
            [BASH, str(SCRIPTS / launcher), *args],
            cwd=self.cwd,
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        calls = [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []
        return Calls(done.returncode, done.stdout, done.stderr, calls)

    def nodefile(self, text: str) -> str:
        """Write a node file, return its path."""
        path = self.cwd / "nodes"
        path.write_text(text)
        return str(path)


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    """Fakes on a PATH of their own."""
    return Cluster(tmp_path)


def flags(args: list[str]) -> dict[str, list[str]]:
    """``--flag v1 v2 ...`` runs of ``args`` by flag; argparse keeps the last of a repeated flag, so do we."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for arg in args:
        if arg.startswith("--"):
            current = out[arg] = []
        else:
            current.append(arg)
    return out


def occurrences(args: list[str]) -> list[str]:
    """The flags of ``args`` in order, repeats included."""
    return [a for a in args if a.startswith("--")]


def after_script(args: list[str], script: str) -> list[str]:
    """The training script's arguments: what follows its path."""
    path = str(SCRIPTS / script)
    assert path in args, (path, args)
    return args[args.index(path) + 1 :]


def same(value: list[str], expected: str) -> bool:
    """Values equal as numbers where both are numbers (0.00045 == 4.5e-4), else as strings."""
    want = expected.split()
    if len(value) != len(want):
        return False
    for a, b in zip(value, want, strict=True):
        try:
            if float(a) != float(b):
                return False
        except ValueError:
            if a != b:
                return False
    return True


def test_every_shell_script_parses() -> None:
    for script in sorted(SCRIPTS.glob("*.sh")):
        done = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, (script.name, done.stderr)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_is_clean() -> None:
    scripts = [str(s) for s in sorted(SCRIPTS.glob("*.sh"))]
    done = subprocess.run(["shellcheck", "-x", *scripts], cwd=SCRIPTS, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_one_node_runs_standalone_torchrun_with_the_paper_recipe(cluster: Cluster, launcher: str) -> None:
    recipe = RECIPES[launcher]
    data = cluster.home / "my data"
    run = cluster.run(launcher, DATA_DIR=str(data))
    assert run.returncode == 0, run.stderr
    assert [c["prog"] for c in run.calls] == ["nvidia-smi", "torchrun"]
    args = run.one("torchrun")
    assert args[:3] == ["--standalone", "--nproc_per_node=4", str(SCRIPTS / recipe.script)]
    train = args[3:]
    got = flags(train)
    assert len(occurrences(train)) == len(got), "a flag is passed twice"
    for flag, value in recipe.flags.items():
        assert flag in got and same(got[flag], value), (flag, got.get(flag), value)
    for flag in recipe.absent:
        assert flag not in got
    assert got["--batch-size"] == [str(recipe.per_gpu * 1 * 4)]
    assert got["--data-dir"] == [str(data)]
    assert got["--log-dir"] == [recipe.log_dir]
    assert got["--solver"] == ["hybrid"]
    assert got["--lr-schedule"] == ["step"]


@pytest.mark.parametrize("launcher", [*LAUNCHERS, "launch_mnist.sh"])
def test_dry_run_prints_the_command_it_would_run_with_known_flags_only(cluster: Cluster, launcher: str) -> None:
    odd = ["--resume", 'it\'s "odd" $HOME *', ""]
    env = {"DATA_DIR": str(cluster.home / "a b")}
    dry = cluster.run(launcher, *odd, DRY_RUN="1", **env)
    assert dry.returncode == 0, dry.stderr
    assert [c["prog"] for c in dry.calls] in ([], ["nvidia-smi"])  # nothing launched
    (line,) = dry.stdout.splitlines()
    printed = shlex.split(line)
    real = cluster.run(launcher, *odd, **env)
    assert real.returncode == 0, real.stderr
    assert printed == ["torchrun", *real.one("torchrun")]
    script = RECIPES[launcher].script if launcher in RECIPES else "train.py"
    train = after_script(printed, script)
    assert train[-3:] == odd
    assert set(occurrences(train)) <= KNOWN_FLAGS


@pytest.mark.parametrize("launcher", [*LAUNCHERS, "launch_mnist.sh"])
def test_the_training_script_accepts_every_launchers_command(cluster: Cluster, launcher: str) -> None:
    """The recipe parses into a RunConfig with the real flags of train.py / train_segmentation.py."""
    from hylo_scripts.training import train as train_script
    from hylo_scripts.training import train_segmentation as seg_script
    from hylo_scripts.training.options import build_parser, config_from_args

    dry = cluster.run(launcher, DRY_RUN="1", DATA_DIR="data")
    assert dry.returncode == 0, dry.stderr
    script = RECIPES[launcher].script if launcher in RECIPES else "train.py"
    module = seg_script if script == "train_segmentation.py" else train_script
    task = "segmentation" if module is seg_script else "classification"
    parser = build_parser(script, task=task, defaults=module.DEFAULTS)
    cfg = config_from_args(parser.parse_args(after_script(shlex.split(dry.stdout), script)), parser)
    if launcher in RECIPES:
        assert cfg.data_dir == "data" and cfg.solver == "hybrid" and cfg.log_dir == RECIPES[launcher].log_dir


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("data_dir", [None, ""])
def test_a_missing_data_dir_is_a_clear_error(cluster: Cluster, launcher: str, data_dir: str | None) -> None:
    env = {} if data_dir is None else {"DATA_DIR": data_dir}
    run = cluster.run(launcher, DRY_RUN="1", **env)
    assert run.returncode != 0
    assert "DATA_DIR is not set" in run.stderr and launcher in run.stderr
    assert run.calls == [] and run.stdout == ""


def test_the_mnist_launcher_needs_no_data_and_runs_two_processes(cluster: Cluster) -> None:
    run = cluster.run("launch_mnist.sh", "--solver", "kid")
    assert run.returncode == 0, run.stderr
    assert run.one("torchrun") == ["--standalone", "--nproc_per_node=2", str(SCRIPTS / "train.py"), "--solver", "kid"]
    assert run.of("nvidia-smi") == []


def test_the_mnist_launcher_keeps_its_by_hand_multi_node_form(cluster: Cluster) -> None:
    """NNODES/NODE_RANK/MASTER start this node's share: the command of docs/training-scripts.md, "Launchers"."""
    run = cluster.run("launch_mnist.sh", "--solver", "hybrid", NNODES="2", NODE_RANK="1", MASTER="node0:29501")
    assert run.returncode == 0, run.stderr
    assert run.one("torchrun") == [
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node0:29501",
        str(SCRIPTS / "train.py"),
        "--solver",
        "hybrid",
    ]
    no_master = cluster.run("launch_mnist.sh", NNODES="2", NODE_RANK="0")
    assert no_master.returncode != 0 and "MASTER=host:port" in no_master.stderr and no_master.calls == []
    bad_rank = cluster.run("launch_mnist.sh", NNODES="2", NODE_RANK="2", MASTER="node0:29500")
    assert bad_rank.returncode != 0 and "NODE_RANK" in bad_rank.stderr and bad_rank.calls == []


def test_extra_arguments_come_last_and_environment_overrides_defaults(cluster: Cluster) -> None:
    env = {
        "DATA_DIR": "data",
        "NPROC": "2",
        "BATCH_PER_GPU": "8",
        "EPOCHS": "3",
        "MILESTONES": "1  2",
        "LR": "0.5",
        "LABEL_SMOOTHING": "",
        "LOG_DIR": "/tmp/a log",
        "SOLVER": "kfac",
    }
    extra = ["--solver", "kis", "--max-steps", "7"]
    run = cluster.run("train-resnet50-imagenet.sh", *extra, **env)
    assert run.returncode == 0, run.stderr
    args = run.one("torchrun")
    assert args[:2] == ["--standalone", "--nproc_per_node=2"]
    assert args[-4:] == extra
    got = flags(args)
    assert got["--batch-size"] == ["16"]
    assert got["--epochs"] == ["3"] and got["--milestone"] == ["1", "2"] and got["--lr"] == ["0.5"]
    assert got["--log-dir"] == ["/tmp/a log"] and got["--data-dir"] == ["data"]
    assert "--label-smoothing" not in got  # an empty value leaves the flag to the script's default
    assert args.count("--solver") == 2 and got["--solver"] == ["kis"]  # argparse: the appended one wins
    assert run.of("nvidia-smi") == []  # NPROC given


@pytest.mark.parametrize(("gpus", "nproc"), [("3", 3), ("0", 1), ("fail", 1)])
def test_nproc_defaults_to_the_gpus_nvidia_smi_lists(cluster: Cluster, gpus: str, nproc: int) -> None:
    run = cluster.run("train-resnet32-cifar10.sh", DATA_DIR="d", FAKE_GPUS=gpus)
    assert run.returncode == 0, run.stderr
    args = run.one("torchrun")
    assert args[1] == f"--nproc_per_node={nproc}"
    assert flags(args)["--batch-size"] == [str(128 * nproc)]
    assert run.one("nvidia-smi") == ["-L"]


def test_without_nvidia_smi_one_process_per_node(cluster: Cluster) -> None:
    cluster.remove("nvidia-smi")
    run = cluster.run("train-unet-lgg.sh", DATA_DIR="d")
    assert run.returncode == 0, run.stderr
    assert run.one("torchrun")[1] == "--nproc_per_node=1"
    assert flags(run.one("torchrun"))["--batch-size"] == ["16"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NPROC": "0"}, "NPROC must be a positive integer"),
        ({"NPROC": "two"}, "NPROC must be a positive integer"),
        ({"BATCH_PER_GPU": "1e3"}, "BATCH_PER_GPU must be a positive integer"),
        ({"NNODES": "3"}, "NNODES=3 but 1 node(s) found"),
        ({"NODEFILE": "/nonexistent/nodes"}, "is not a readable file"),
        ({"MASTER": "node0"}, "MASTER must be host:port"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(cluster: Cluster, env: dict[str, str], message: str) -> None:
    run = cluster.run("train-resnet32-cifar10.sh", DATA_DIR="d", **env)
    assert run.returncode != 0
    assert message in run.stderr
    assert run.of("torchrun") == [] and run.of("ssh") == [] and run.of("srun") == []


def test_exit_status_of_torchrun_is_the_launchers(cluster: Cluster) -> None:
    run = cluster.run("train-densenet-cifar100.sh", DATA_DIR="d", FAKE_EXIT="7")
    assert run.returncode == 7


SLURM = {"SLURM_JOB_ID": "4242", "FAKE_HOSTS": "gpu01 gpu02 gpu03", "FAKE_GPUS": "2", "DATA_DIR": "d"}


@pytest.mark.parametrize("variable", ["SLURM_JOB_NODELIST", "SLURM_NODELIST"])
def test_slurm_starts_one_torchrun_per_node_with_srun(cluster: Cluster, variable: str) -> None:
    run = cluster.run("train-resnet50-imagenet.sh", "--seed", "3", **SLURM, **{variable: "gpu[01-03]"})
    assert run.returncode == 0, run.stderr
    assert run.one("scontrol") == ["show", "hostnames", "gpu[01-03]"]
    assert run.of("torchrun") == [] and run.of("ssh") == []
    args = run.one("srun")
    assert args[:10] == [
        "--nodes=3",
        "--ntasks-per-node=1",
        "torchrun",
        "--nnodes=3",
        "--nproc_per_node=2",
        "--rdzv_id=4242",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu01:29500",
        str(SCRIPTS / "train.py"),
        "--data-dir",
    ]
    assert flags(args)["--batch-size"] == [str(80 * 3 * 2)]
    assert args[-2:] == ["--seed", "3"]


def test_slurm_on_fewer_nodes_names_them_and_takes_the_master_port(cluster: Cluster) -> None:
    run = cluster.run(
        "train-resnet32-cifar10.sh", **SLURM, SLURM_JOB_NODELIST="gpu[01-03]", NNODES="2", MASTER_PORT="12345"
    )
    assert run.returncode == 0, run.stderr
    args = run.one("srun")
    assert args[:3] == ["--nodes=2", "--ntasks-per-node=1", "--nodelist=gpu01,gpu02"]
    assert "--nnodes=2" in args and "--rdzv_endpoint=gpu01:12345" in args
    assert flags(args)["--batch-size"] == [str(128 * 2 * 2)]


def test_a_one_node_slurm_job_runs_standalone(cluster: Cluster) -> None:
    run = cluster.run("train-resnet32-cifar10.sh", **{**SLURM, "FAKE_HOSTS": "gpu07"}, SLURM_JOB_NODELIST="gpu07")
    assert run.returncode == 0, run.stderr
    assert run.of("srun") == [] and run.one("torchrun")[:2] == ["--standalone", "--nproc_per_node=2"]


def test_slurm_nodes_without_srun_are_reached_by_ssh(cluster: Cluster) -> None:
    cluster.remove("srun")
    run = cluster.run("train-3c1f-fashion-mnist.sh", **SLURM, SLURM_JOB_NODELIST="gpu[01-03]")
    assert run.returncode == 0, run.stderr
    assert sorted(a[0] for a in run.of("ssh")) == ["gpu01", "gpu02", "gpu03"]  # in parallel: any order
    assert len(run.of("torchrun")) == 3


NODES = "node-a slots=4\n# a comment\n\nnode-b\nnode-a\n  node-c  # last\n"
PRELOAD = "export HYLO_PRELOADED='yes, it ran'"  # no trailing ';': the launcher adds it


def test_a_node_file_starts_every_node_by_ssh(cluster: Cluster) -> None:
    extra = ["--kl-clip", "it's $HOME"]
    env = {"NODEFILE": cluster.nodefile(NODES), "PRELOAD": PRELOAD, "NPROC": "2", "DATA_DIR": "my data"}
    run = cluster.run("train-resnet32-cifar10.sh", *extra, **env)
    assert run.returncode == 0, run.stderr
    ssh = run.of("ssh")
    assert sorted(a[0] for a in ssh) == ["node-a", "node-b", "node-c"]  # repeats and comments dropped
    for args in ssh:
        assert len(args) == 2 and args[1].startswith(PRELOAD + ";")
    torchruns = [c for c in run.calls if c["prog"] == "torchrun"]
    assert len(torchruns) == 3
    rank = {}
    for call in torchruns:
        args = call["args"]
        assert call["env"]["HYLO_PRELOADED"] == "yes, it ran"  # PRELOAD ran first, in the same shell
        assert call["cwd"] == str(cluster.cwd)  # the remote shell moved to the launch directory
        assert args[0] == "--nnodes=3" and "--nproc_per_node=2" in args
        assert "--rdzv_backend=c10d" in args and "--rdzv_endpoint=node-a:29500" in args
        rank[call["env"]["FAKE_SSH_HOST"]] = next(a for a in args if a.startswith("--node_rank="))
        got = flags(after_script(args, "train.py"))
        assert got["--batch-size"] == [str(128 * 3 * 2)]
        assert got["--data-dir"] == ["my data"]
        assert args[-2:] == extra  # quoted for the remote shell: no expansion, no splitting
    assert rank == {"node-a": "--node_rank=0", "node-b": "--node_rank=1", "node-c": "--node_rank=2"}  # file order
    ids = {a for c in torchruns for a in c["args"] if a.startswith("--rdzv_id=")}
    assert len(ids) == 1  # one rendezvous for all the nodes


def test_a_failing_node_fails_the_launch_after_the_others_finish(cluster: Cluster) -> None:
    env = {"NODEFILE": cluster.nodefile(NODES), "DATA_DIR": "d", "FAKE_SSH_FAIL": "node-b"}
    run = cluster.run("train-densenet-cifar100.sh", **env)
    assert run.returncode == 3
    assert "node node-b (node_rank 1) failed with exit status 3" in run.stderr
    assert sorted(c["env"]["FAKE_SSH_HOST"] for c in run.calls if c["prog"] == "torchrun") == ["node-a", "node-c"]


def test_dry_run_over_a_node_file_prints_one_ssh_per_node(cluster: Cluster) -> None:
    env = {"NODEFILE": cluster.nodefile(NODES), "DATA_DIR": "d", "PRELOAD": "module load cuda;", "DRY_RUN": "1"}
    run = cluster.run("train-unet-lgg.sh", **env)
    assert run.returncode == 0, run.stderr
    assert [c["prog"] for c in run.calls] == ["nvidia-smi"]
    lines = [shlex.split(line) for line in run.stdout.splitlines()]
    assert [line[:2] for line in lines] == [["ssh", "node-a"], ["ssh", "node-b"], ["ssh", "node-c"]]
    for i, (_, _, remote) in enumerate(lines):
        assert remote.startswith("module load cuda; cd ")
        words = shlex.split(remote.removeprefix("module load cuda;"))
        assert words[:4] == ["cd", str(cluster.cwd), "&&", "torchrun"]
        assert f"--node_rank={i}" in words
        train = after_script(words, "train_segmentation.py")
        assert set(occurrences(train)) <= KNOWN_FLAGS
        assert flags(train)["--batch-size"] == [str(16 * 3 * 4)]


@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_an_empty_node_file_is_refused(cluster: Cluster, text: str) -> None:
    run = cluster.run("train-resnet32-cifar10.sh", DATA_DIR="d", NODEFILE=cluster.nodefile(text))
    assert run.returncode != 0 and "lists no host" in run.stderr
    assert run.calls == []
