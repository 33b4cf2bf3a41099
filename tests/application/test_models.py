"""hylo_scripts/models/registry.py: every registered model builds and runs at its canonical shape and a small one,
refuses the shapes it cannot take with a reason, and has the parameters and layers its
architecture's formulas give (counted by hand below, not from the builders)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo_scripts.models.registry import MODELS, Shape, build_model, models_for

pytestmark = pytest.mark.usefixtures("single_thread")

Hook = Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]

#: A small shape (and class count) each model takes, non-square and non-canonical where allowed.
SMALL: dict[str, tuple[Shape, int]] = {
    "cnn": ((3, 8, 12), 7),
    "mlp": ((2, 5, 7), 3),
    "3c1f": ((1, 7, 10), 4),
    "resnet20": ((3, 8, 12), 5),
    "resnet32": ((3, 4, 4), 10),
    "resnet56": ((3, 8, 8), 2),
    "densenet": ((3, 8, 12), 100),
    "resnet50": ((1, 32, 48), 6),
    "unet": ((1, 16, 32), 2),
    "transformer": ((24,), 50),
}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def expected_output(name: str, batch: int, shape: Shape, classes: int) -> tuple[int, ...]:
    if MODELS[name].task == "segmentation":
        return (batch, classes, shape[1], shape[2])
    if MODELS[name].task == "lm":
        return (batch, shape[0], classes)
    return (batch, classes)


def inputs(name: str, batch: int, shape: Shape, classes: int) -> Tensor:
    """Random images, or random tokens of the vocabulary for a language model."""
    if MODELS[name].task == "lm":
        return torch.randint(0, classes, (batch, *shape))
    return torch.randn(batch, *shape)


def test_the_registry_holds_the_models_of_the_issue() -> None:
    assert list(MODELS) == [
        *("cnn", "mlp", "3c1f", "resnet20", "resnet32", "resnet56", "densenet", "resnet50", "unet", "transformer")
    ]
    assert SMALL.keys() == MODELS.keys()
    assert {name for name, spec in MODELS.items() if spec.task == "segmentation"} == {"unet"}
    assert {name for name, spec in MODELS.items() if spec.task == "lm"} == {"transformer"}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_runs_at_its_canonical_and_a_small_shape(name: str) -> None:
    spec = MODELS[name]
    assert spec.fits(spec.input_shape, spec.num_classes) is None
    with torch.no_grad():
        x, y = spec.random_batch(2)
        out = build_model(name)(x)
        assert out.shape == expected_output(name, 2, spec.input_shape, spec.num_classes)
        assert y.shape == {"segmentation": out.shape, "lm": out.shape[:2]}.get(spec.task, (2,))
        shape, classes = SMALL[name]
        assert spec.fits(shape, classes) is None
        out = build_model(name, shape, classes)(inputs(name, 2, shape, classes))
        assert out.shape == expected_output(name, 2, shape, classes)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("name", "shape", "classes", "reason"),
    [
        ("cnn", (1, 3, 28), 10, "at least 4, got 3×28"),
        ("3c1f", (1, 28, 2), 10, "at least 3, got 28×2"),
        ("resnet32", (1, 32, 32), 10, "3-channel images, got 1 channels"),
        ("resnet20", (3, 3, 32), 10, "at least 4"),
        ("densenet", (4, 32, 32), 10, "3-channel images, got 4 channels"),
        ("densenet", (3, 32, 2), 10, "at least 4"),
        ("resnet50", (3, 31, 224), 1000, "at least 32, got 31×224"),
        ("unet", (3, 256, 248), 1, "divisible by 16, got 256×248"),
        ("unet", (3, 8, 8), 1, "divisible by 16"),
        ("mlp", (0, 28, 28), 10, "positive sizes"),
        ("mlp", (28, 28), 10, "(C, H, W)"),
        ("mlp", (1, 28, 28), 1, "at least 2 classes, got 1"),
        ("unet", (3, 32, 32), 0, "at least 1 classes, got 0"),
    ],
)
def test_fits_refuses_with_the_reason(name: str, shape: Shape, classes: int, reason: str) -> None:
    found = MODELS[name].fits(shape, classes)
    assert found is not None and reason in found
    with pytest.raises(ValueError, match=f"model '{name}' does not take") as error:
        build_model(name, shape, classes)
    assert reason in str(error.value)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("cnn", (1, 4, 4)), ("3c1f", (1, 3, 3)), ("resnet50", (2, 32, 32)), ("unet", (3, 16, 16)), ("mlp", (1, 1, 1))],
)
def test_fits_accepts_the_smallest_shape(name: str, shape: Shape) -> None:
    assert MODELS[name].fits(shape) is None
    with torch.no_grad():
        assert build_model(name, shape).eval()(torch.randn(1, *shape)).shape[0] == 1


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize(("name", "shape"), [("cnn", (1, 3, 3)), ("3c1f", (1, 2, 2))])
def test_the_refused_sides_really_fail(name: str, shape: Shape) -> None:
    """Below the limit the pooling leaves nothing for the linear layer: the refusal is not arbitrary."""
    with pytest.raises(RuntimeError), torch.no_grad():
        MODELS[name].build(shape, 10)(torch.randn(1, *shape))


def test_models_for_lists_the_fitting_models_of_a_task() -> None:
    assert models_for((1, 28, 28), 10) == ["cnn", "mlp", "3c1f"]
    cifar = ["cnn", "mlp", "3c1f", "resnet20", "resnet32", "resnet56", "densenet", "resnet50"]
    assert models_for((3, 32, 32), 100) == cifar
    assert models_for((3, 224, 224), 1000)[-1] == "resnet50"
    assert models_for((3, 256, 256), 1, task="segmentation") == ["unet"]
    assert models_for((3, 250, 250), 1, task="segmentation") == []
    assert models_for((3, 32, 32), 1) == []
    with pytest.raises(ValueError, match="task must be one of"):
        models_for((3, 32, 32), 10, task="detection")
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg")


def test_cifar_resnet_parameter_counts() -> None:
    """Per 6k+2 ResNet with n = k blocks per stage, 10 classes, bias-free convs, option A:
    stem 3·16·9 + BN 2·16; stage 1: 2n convs 16·16·9; stage 2: 16·32·9 + (2n−1)·32·32·9;
    stage 3: 32·64·9 + (2n−1)·64·64·9; BN 2·2n·(16+32+64); fc 64·10+10
    = 97,216·n − 21,926 (0.27M, 0.46M, 0.85M: the published counts of these networks)."""
    for name, n, published in (("resnet20", 3, 269_722), ("resnet32", 5, 464_154), ("resnet56", 9, 853_018)):
        model = build_model(name)
        assert n_params(model) == 97_216 * n - 21_926 == published, name
        stem = 3 * 16 * 9 + 2 * 16
        stages = (
            2 * n * 16 * 16 * 9
            + 16 * 32 * 9
            + (2 * n - 1) * 32 * 32 * 9
            + 32 * 64 * 9
            + (2 * n - 1) * 64 * 64 * 9
            + 2 * 2 * n * (16 + 32 + 64)
        )
        assert n_params(model) == stem + stages + 64 * 10 + 10
        assert n_params(build_model(name, num_classes=100)) == published + 90 * 64 + 90


def test_cifar_resnet_depth_counts_the_layers_hylo_registers() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hylo leaves")
        for name, depth in (("resnet20", 20), ("resnet32", 32), ("resnet56", 56)):
            pre = hylo.HyLoPreconditioner(build_model(name))
            assert len(pre.layer_info()) == depth, name
            pre.remove()


def test_option_a_shortcut_has_no_parameters_and_zero_pads_the_subsampled_input() -> None:
    model = build_model("resnet20")
    block = model.layers[3]  # the first block of stage 2: 16 -> 32 channels, stride 2
    own = {name.split(".")[0] for name, _ in block.named_parameters()}
    assert own == {"conv1", "bn1", "conv2", "bn2"}
    assert n_params(block) == 16 * 32 * 9 + 32 * 32 * 9 + 2 * 2 * 32
    with torch.no_grad():
        block.conv2.weight.zero_()  # the residual branch becomes BN(0) = its zero bias
        x = torch.randn(2, 16, 8, 6)
        out = block(x)
    expected = torch.zeros(2, 32, 4, 3)
    expected[:, 8:24] = x[:, :, 0::2, 0::2]
    assert torch.equal(out, F.relu(expected))


def test_3c1f_at_28x28() -> None:
    model = build_model("3c1f")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(128 * 9 * 9, 500), (500, 10)]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(m.in_channels, m.out_channels, m.kernel_size, m.padding) for m in convs] == [
        (1, 128, (3, 3), (1, 1)),
        (128, 128, (3, 3), (1, 1)),
        (128, 128, (3, 3), (1, 1)),
    ]
    assert n_params(model) == (9 * 128 + 128) + 2 * (9 * 128 * 128 + 128) + (10_368 * 500 + 500) + (500 * 10 + 10)
    assert n_params(model) == 5_485_958


def test_cnn_and_mlp_are_todays_mnist_nets_at_28x28() -> None:
    assert n_params(build_model("cnn")) == (25 * 8 + 8) + (25 * 8 * 16 + 16) + (16 * 7 * 7 * 64 + 64) + (64 * 10 + 10)
    assert n_params(build_model("mlp")) == (784 * 256 + 256) + (256 * 128 + 128) + (128 * 10 + 10)
    linear = next(m for m in build_model("cnn", (3, 8, 12)).modules() if isinstance(m, nn.Linear))
    assert linear.in_features == 16 * 2 * 3


def densenet_bc_params(depth: int, growth: int, classes: int) -> tuple[int, list[int]]:
    """Parameters of a DenseNet-BC (compression 0.5) and its channels after each block, by hand:
    a bottleneck layer on c channels has BN 2c, 1×1 conv c·4k, BN 2·4k and 3×3 conv 4k·k·9, so a
    block of n layers starting at c0 channels has 50·Σc + n·(8k + 36k²) parameters with
    Σc = n·c0 + k·n(n−1)/2, and ends at c0 + n·k channels."""
    n, k = (depth - 4) // 6, growth
    total, channels, ends = 3 * 2 * k * 9, 2 * k, []
    for block in range(3):
        total += 2 * (n * channels + k * n * (n - 1) // 2) + 4 * k * (n * channels + k * n * (n - 1) // 2)
        total += n * (2 * 4 * k + 4 * k * k * 9)
        channels += n * k
        ends.append(channels)
        if block < 2:
            total += 2 * channels + channels * (channels // 2)  # transition: BN and 1×1 conv
            channels //= 2
    return total + 2 * channels + channels * classes + classes, ends


def test_densenet_channel_bookkeeping_and_parameters() -> None:
    total, ends = densenet_bc_params(40, 12, 10)
    assert ends == [24 + 72, 48 + 72, 60 + 72] == [96, 120, 132]
    model = build_model("densenet")
    assert n_params(model) == total == 176_122
    assert n_params(build_model("densenet", num_classes=100)) == densenet_bc_params(40, 12, 100)[0]
    seen: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def record(name: str) -> Hook:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            seen.append((name, tuple(inputs[0].shape), tuple(output.shape)))

        return hook

    for module in model.features:
        module.register_forward_hook(record(type(module).__name__))
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    transitions = [(i, o) for kind, i, o in seen if kind == "_Transition"]
    assert transitions == [((2, 96, 32, 32), (2, 48, 16, 16)), ((2, 120, 16, 16), (2, 60, 8, 8))]
    layers = [(i[1], o[1]) for kind, i, o in seen if kind == "_DenseLayer"]
    starts = [24 + 12 * i for i in range(6)] + [48 + 12 * i for i in range(6)] + [60 + 12 * i for i in range(6)]
    assert layers == [(c, c + 12) for c in starts]
    assert model.fc.in_features == 132
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) + 1 == 40  # depth: stem, 2 convs per bottleneck layer, 2 transitions, classifier
    bottlenecks = [m for m in model.features if type(m).__name__ == "_DenseLayer"]
    assert {(m.conv1.kernel_size, m.conv1.out_channels, m.conv2.kernel_size) for m in bottlenecks} == {
        ((1, 1), 48, (3, 3))
    }


def unet_params(in_channels: int, out_channels: int, f: int) -> int:
    """Double conv a->b: 9ab + 9b² + 2·2b (bias-free convs, two BNs); up-conv a->b: 4ab + b; head: f·out + out."""

    def double(a: int, b: int) -> int:
        return 9 * a * b + 9 * b * b + 4 * b

    encoders = double(in_channels, f) + double(f, 2 * f) + double(2 * f, 4 * f) + double(4 * f, 8 * f)
    bottleneck = double(8 * f, 16 * f)
    ups = sum(4 * (2 * c) * c + c for c in (8 * f, 4 * f, 2 * f, f))
    decoders = sum(double(2 * c, c) for c in (8 * f, 4 * f, 2 * f, f))
    return encoders + bottleneck + ups + decoders + f * out_channels + out_channels


def test_unet_parameters_skips_and_logit_output() -> None:
    model = build_model("unet", (3, 32, 48))
    assert n_params(model) == unet_params(3, 1, 32) == 7_763_041
    assert n_params(build_model("unet", (1, 16, 16), 2)) == unet_params(1, 2, 32)
    outputs: dict[str, Tensor] = {}
    inputs: dict[str, Tensor] = {}

    def keep(name: str) -> Hook:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            inputs[name], outputs[name] = args[0].clone(), output.clone()

        return hook

    for name in [f"encoder{level}" for level in range(1, 5)] + [f"decoder{level}" for level in range(1, 5)] + ["conv"]:
        model.get_submodule(name).register_forward_hook(keep(name))
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 48))
    for level, (channels, side) in zip((1, 2, 3, 4), ((32, 1), (64, 2), (128, 4), (256, 8)), strict=True):
        skip = outputs[f"encoder{level}"]
        assert skip.shape == (2, channels, 32 // side, 48 // side)
        concatenated = inputs[f"decoder{level}"]
        assert concatenated.shape == (2, 2 * channels, 32 // side, 48 // side)
        assert torch.equal(concatenated[:, channels:], skip)  # the skip is concatenated after the up-sampled maps
    ups = [m for m in model.modules() if isinstance(m, nn.ConvTranspose2d)]
    assert [(m.kernel_size, m.stride) for m in ups] == [((2, 2), (2, 2))] * 4
    assert out.shape == (2, 1, 32, 48)
    assert torch.equal(out, outputs["conv"])  # logits straight from the 1×1 conv: no sigmoid
    assert model.conv.kernel_size == (1, 1) and out.min() < 0


def supported(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.ConvTranspose2d))]


@pytest.mark.parametrize(
    ("name", "layers"),
    [("cnn", 4), ("mlp", 3), ("3c1f", 5), ("densenet", 40), ("resnet50", 54), ("unet", 23)],
)
def test_hylo_registers_the_linear_and_conv_layers(name: str, layers: int) -> None:
    """resnet50: 1 + 16·3 + 1 = 50 plus 4 projection shortcuts; unet: 9 double convs, the head and 4 up-convolutions."""
    shape, classes = SMALL[name]
    model = build_model(name, shape, classes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = hylo.HyLoPreconditioner(model)
    info = pre.layer_info()
    registered = [layer.name for layer in info]
    assert registered == supported(model) and len(registered) == layers
    summary = pre.summary()
    pre.remove()
    assert "not a supported layer type" not in summary and not [w for w in caught if "hylo leaves" in str(w.message)]
    if name == "unet":
        ups = {layer.name: layer.module_type for layer in info if layer.name.startswith("upconv")}
        assert ups == {f"upconv{level}": "ConvTranspose2d" for level in (4, 3, 2, 1)}
