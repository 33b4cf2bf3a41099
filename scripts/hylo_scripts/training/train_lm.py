"""Train a byte-level transformer language model with an optimizer + hylo, on one process or many (torchrun).

Offline default: a decoder-only transformer (4 pre-LayerNorm blocks of width 256 with 4
attention heads, context 128, learned token and position embeddings, an untied head) on the
.py files of the running Python's standard library, modelled byte by byte (vocabulary 256),
with AdamW, a warm-up and a cosine lr, and hylo's hybrid solver: 2 epochs of 0.3 MB of training
text, three to four minutes on two CPU cores.

    python scripts/train_lm.py --solver kfac --log-dir runs/lm-kfac
    python scripts/train_lm.py --solver none --epochs 4 --max-bytes 2000000 --lr 2e-3
    python scripts/train_lm.py --dataset text --data-dir ~/corpus --seq-len 256 --layers 6 --width 384 --heads 6
    torchrun --standalone --nproc_per_node=2 scripts/train_lm.py --solver kid

Data (scripts/hylo_scripts/data/text.py): the stdlib's .py files outside site-packages, the test suites, idlelib,
turtledemo and pydoc_data, or with --dataset text every file under --data-dir. The split is by
file and fixed: files ordered by zlib.crc32 of their path relative to the root, the first
tenth (at least one) validation, the rest training; no seed changes it. --max-bytes caps the
training bytes (validation: a tenth of the cap; 0: no cap), reading each split's files in
that order. An epoch is one pass over the non-overlapping --seq-len windows of the training
bytes. The standard library differs between Python versions, so the corpus does too: the
run prints, and writes to DIR/dataset.json, the Python version and the files, bytes and
windows of each split.

The loss is the mean cross-entropy over all tokens. metrics.csv has the validation loss in
nats per token (test_loss) and in bits per byte (test_bpb = test_loss / ln 2) after every
epoch. The flags, outputs, checkpoints, --resume and profiling are those of train.py (python
scripts/train.py --help); --batch-size is the global batch of windows. --image-size,
--image-backend do not exist here and --conv-rows, --label-smoothing are errors.
"""

from __future__ import annotations

from hylo_scripts.training.options import run_script

#: train_lm.py's defaults: the standard library's bytes with the small transformer, AdamW + hylo's hybrid policy.
DEFAULTS = {
    "dataset": "stdlib",
    "model": "transformer",
    "epochs": 2,
    "batch_size": 32,
    "max_bytes": 300_000,
    "optimizer": "adamw",  # its lr: hylo_options.TRAINER_LRS["lm"]
    "lr_schedule": "cosine",
    "warmup_epochs": 0.2,
    "weight_decay": 0.01,
}


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and train (exit status: 0 done, 1 data problem, 2 flag misuse or a log dir that cannot be used)."""
    return run_script(__doc__ or "", argv, task="lm", defaults=DEFAULTS)


if __name__ == "__main__":
    raise SystemExit(main())
