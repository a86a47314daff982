"""wide_compiler.integrations.transformers: N fused members trained by one transformers.Trainer
match each member trained alone by a plain Trainer (weights, optimizer state, per-member
learning-rate schedules, logged losses, evaluation), save one loadable directory per member, and
refuse what cannot be per member.

Tiny-config models as in real_models.py (no downloads), float64 and dropout 0 so that rounding
cannot hide a difference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import wide_compiler as wc  # noqa: E402
from wide_compiler.errors import ArchitectureMismatchError  # noqa: E402
from support import DEVICE  # noqa: E402
from wide_compiler.integrations.transformers import (  # noqa: E402
    WideTrainer,
    WideTransformersModel,
    member_arguments,
)

N = 4
#: Most tests train the same members (_member): they check the trainer, not the capture, so one
#: compile cache per module stores each graph once and the later tests load it (conftest's
#: module_compile_cache; a cache hit is the fresh compile bit for bit: test_compile_cache.py).
pytestmark = pytest.mark.usefixtures("module_compile_cache")
STEPS = 12  # three logging steps (logging_steps=4) after a warmup of 3: the schedules already differ
LRS = [1e-3, 3e-3, 1e-2, 3e-2]
WDS = [0.0, 0.01, 0.1, 0.0]
CLIP = [1.0, 0.5, 0.0, 1.0]                 # member 2: no clipping
SCHEDULES = ["linear", "cosine", "constant_with_warmup", "polynomial"]


def _config(**over):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BertConfig(**{**base, **over})


def _member(seed: int, config=None):
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(config or _config()).double()


def _data(n: int, seed: int) -> list[dict]:
    g = torch.Generator(DEVICE).manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 64, (8,), generator=g)
        mask = torch.ones(8, dtype=torch.long)
        mask[int(torch.randint(5, 9, (), generator=g)):] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": int(ids[:3].sum() % 3)})
    return out


def _args(tmp, **over):
    base = dict(output_dir=str(tmp), max_steps=STEPS, per_device_train_batch_size=8, per_device_eval_batch_size=6,
                report_to=[], disable_tqdm=True, use_cpu=True, logging_steps=4, save_strategy="no", warmup_steps=3,
                seed=0)
    return transformers.TrainingArguments(**{**base, **over})


def _accuracy(pred):
    logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
    return {"accuracy": float((logits.argmax(-1) == pred.label_ids).mean())}


def _member_args(tmp):
    return member_arguments(_args(tmp), learning_rate=LRS, weight_decay=WDS, max_grad_norm=CLIP,
                            lr_scheduler_type=SCHEDULES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, module_cache_dir):
    """One fused run of N members and N plain Trainer runs, each member alone (the module's
    compile cache on: a module-scoped fixture runs before the function-scoped ones)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WIDE_COMPILE_CACHE", "1")
        mp.setenv("WIDE_COMPILER_CACHE_DIR", str(module_cache_dir))
        return _runs(tmp_path_factory.mktemp("hf"))


def _runs(tmp):
    train, evals = _data(96, 0), _data(20, 1)
    args = _member_args(tmp / "wide")
    wide = WideTrainer(model=[_member(i) for i in range(N)], args=args, train_dataset=train,
                       eval_dataset=evals, compute_metrics=_accuracy)
    wide.train()
    wide_eval = wide.evaluate()
    alone = []
    for i in range(N):
        t = transformers.Trainer(model=_member(i), args=dataclasses.replace(args[i], output_dir=str(tmp / f"a{i}")),
                                 train_dataset=train, eval_dataset=evals, compute_metrics=_accuracy)
        t.train()
        alone.append((t, t.evaluate()))
    return wide, wide_eval, alone, tmp


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # relative to the tensor's largest value; a tensor ~0 (an attention key bias: its gradient is 0 up to
    # rounding, which Adam normalises into noise) is compared to 1e-3 instead
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-3))


def test_members_match_trainer_alone(runs):
    wide, _, alone, _ = runs
    for i, (t, _) in enumerate(alone):
        got = wide.model.member(i).state_dict()
        want = t.model.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            assert _rel(got[name], want[name]) <= 1e-6, (i, name)
        moved = _rel(got["classifier.weight"], _member(i).state_dict()["classifier.weight"])
        assert moved > 1e-3, "the member did not train"


def test_optimizer_state_matches(runs):
    wide, _, alone, _ = runs
    wide_names = {id(p): name for name, p in wide.model.wide.named_parameters()}
    opt = getattr(wide.optimizer, "optimizer", wide.optimizer)        # inside accelerate's wrapper
    assert isinstance(opt, wc.optim.AdamW)
    for i, (t, _) in enumerate(alone):
        names = {id(p): name for name, p in t.model.named_parameters()}
        want = {names[id(p)]: st for p, st in t.optimizer.state.items()}
        got = {wide_names[id(p)]: st for p, st in opt.state.items()}
        assert got.keys() == want.keys() and len(want) > 10
        for name, st in want.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert _rel(got[name][key][i], st[key]) <= 1e-9, (i, name, key)
            assert float(got[name]["step"].reshape(-1)[0]) == float(st["step"]) == STEPS


def test_per_member_logs_and_schedules(runs):
    wide, _, alone, _ = runs
    wlogs = [h for h in wide.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(wlogs) == STEPS // 4
    for i, (t, _) in enumerate(alone):
        tlogs = [h for h in t.state.log_history if "loss" in h and "train_runtime" not in h]
        assert [h["step"] for h in tlogs] == [h["step"] for h in wlogs]
        for w, a in zip(wlogs, tlogs):
            # the Trainer sums the logged loss in float32; the fused run keeps each member's in float64
            assert w[f"loss_member_{i}"] == pytest.approx(a["loss"], rel=1e-6)
            assert w[f"learning_rate_member_{i}"] == pytest.approx(a["learning_rate"], rel=1e-12)
            assert w[f"grad_norm_member_{i}"] == pytest.approx(a["grad_norm"], rel=1e-9)
    # the four schedule types really differ, and the logged shared value is the mean
    last = wlogs[-1]
    lrs = [last[f"learning_rate_member_{i}"] for i in range(N)]
    assert len({round(v / lr, 6) for v, lr in zip(lrs, LRS)}) == N
    assert last["learning_rate"] == pytest.approx(sum(lrs) / N)
    assert last["loss"] == pytest.approx(sum(last[f"loss_member_{i}"] for i in range(N)) / N, rel=1e-6)


def test_per_member_evaluation(runs):
    _, wide_eval, alone, _ = runs
    for i, (_, ev) in enumerate(alone):
        assert wide_eval[f"eval_loss_member_{i}"] == pytest.approx(ev["eval_loss"], rel=1e-9)
        assert wide_eval[f"eval_accuracy_member_{i}"] == ev["eval_accuracy"]
    assert wide_eval["eval_loss"] == pytest.approx(sum(ev["eval_loss"] for _, ev in alone) / N, rel=1e-9)
    assert wide_eval["eval_accuracy"] == pytest.approx(sum(ev["eval_accuracy"] for _, ev in alone) / N)


def test_save_pretrained_per_member(runs):
    wide, _, alone, tmp = runs
    out = tmp / "saved"
    wide.save_model(str(out))
    for i, (t, _) in enumerate(alone):
        path = out / f"member_{i}"
        assert (path / "config.json").exists() and (path / "training_args.bin").exists()
        loaded = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float64)
        assert type(loaded) is transformers.BertForSequenceClassification
        got, want = loaded.state_dict(), wide.model.member(i).state_dict()
        for name in want:
            assert torch.equal(got[name], want[name]), (i, name)
        assert torch.load(path / "training_args.bin", weights_only=False).learning_rate == LRS[i]


def test_from_config_seeds_and_shared_args(tmp_path):
    """N seeds of one config, one shared TrainingArguments: member i is the model built under seed i."""
    model = WideTransformersModel.from_config(transformers.BertForSequenceClassification, _config(),
                                              seeds=[5, 6], dtype=torch.float64)
    t = WideTrainer(model=model, args=_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1),
                    train_dataset=_data(16, 2))
    with torch.random.fork_rng():   # the data order of t.train() (and of a resumed run) is drawn from it
        for i, seed in enumerate([5, 6]):
            want = _member(seed).state_dict()
            got = t.model.member(i).state_dict()
            assert all(torch.equal(got[k], want[k]) for k in want)
    t.train()
    assert t.lr_scheduler.member_lrs()[0] == t.lr_scheduler.member_lrs()[1]
    # checkpoints: one from_pretrained directory per member, plus the Trainer's optimizer/scheduler files
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "member_1" / "config.json").exists() and (ckpt / "optimizer.pt").exists()
    loaded = transformers.BertForSequenceClassification.from_pretrained(str(ckpt / "member_1"), dtype=torch.float64)
    want = t.model.member(1).state_dict()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    # resumed from step 1, a new WideTrainer ends where the uninterrupted run ended
    resumed = WideTrainer(model=WideTransformersModel.from_config(
        transformers.BertForSequenceClassification, _config(), seeds=[7, 8], dtype=torch.float64),
        args=_args(tmp_path, max_steps=2, save_strategy="no"), train_dataset=_data(16, 2))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    for i in range(2):
        got, want = resumed.model.member(i).state_dict(), t.model.member(i).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), i


def test_shared_argument_differing_per_member_is_an_error(tmp_path):
    args = [_args(tmp_path), _args(tmp_path, gradient_accumulation_steps=2)]
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps.*member 1"):
        WideTrainer(model=[_member(0), _member(1)], args=args, train_dataset=_data(16, 2))
    with pytest.raises(ValueError, match=r"cannot differ between members"):
        member_arguments(_args(tmp_path), per_device_train_batch_size=[8, 16])


@pytest.mark.parametrize("over, key", [
    (dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"), "load_best_model_at_end"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
    (dict(lr_scheduler_type="reduce_lr_on_plateau"), "lr_scheduler_type"),
])
def test_unsupported_shared_arguments(tmp_path, over, key):
    with pytest.raises(ValueError, match=key):
        WideTrainer(model=[_member(0), _member(1)], args=_args(tmp_path, **over), train_dataset=_data(16, 2))


def test_optimizer_without_per_member_form(tmp_path):
    t = WideTrainer(model=[_member(0), _member(1)], args=_args(tmp_path, optim="adafactor"),
                    train_dataset=_data(16, 2))
    with pytest.raises(ValueError, match=r"optim='?adafactor.*member 0"):
        t.create_optimizer()


@pytest.mark.parametrize("over, key", [(dict(num_hidden_layers=2), "num_hidden_layers"),
                                       (dict(hidden_act="relu"), "hidden_act")])
def test_configs_that_change_the_model(over, key):
    with pytest.raises(ArchitectureMismatchError, match=rf"member 1's config has {key}"):
        WideTransformersModel([_member(0), _member(1, _config(**over))])


def test_causal_lm_sgd_gradient_accumulation(tmp_path):
    """Another family and optimizer: a GPT-2 language model (tied head; the Trainer passes
    num_items_in_batch into its loss), SGD with momentum from optim_args, gradient accumulation,
    per-member learning rates; each member equals its plain Trainer run."""
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=2, eos_token_id=2)

    def member(seed):
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(cfg).double()

    data = [{"input_ids": d["input_ids"], "attention_mask": d["attention_mask"],
             "labels": d["input_ids"].masked_fill(d["attention_mask"] == 0, -100)} for d in _data(48, 3)]
    args = member_arguments(_args(tmp_path, optim="sgd", optim_args="momentum=0.9", max_steps=6,
                                  gradient_accumulation_steps=2, logging_steps=2), learning_rate=[0.05, 0.1])
    wide = WideTrainer(model=[member(0), member(1)], args=args, train_dataset=data)
    wide.train()
    opt = getattr(wide.optimizer, "optimizer", wide.optimizer)
    assert isinstance(opt, wc.optim.SGD) and opt.param_groups[0]["momentum"].tolist() == [0.9, 0.9]
    wlogs = [h for h in wide.state.log_history if "loss" in h and "train_runtime" not in h]
    for i in range(2):
        t = transformers.Trainer(model=member(i), args=args[i], train_dataset=data)
        t.train()
        got, want = wide.model.member(i).state_dict(), t.model.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            assert _rel(got[name], want[name]) <= 1e-6, (i, name)
        m = wide.model.member(i)
        assert m.lm_head.weight is m.transformer.wte.weight          # the tie survives
        tlogs = [h for h in t.state.log_history if "loss" in h and "train_runtime" not in h]
        assert [w[f"loss_member_{i}"] for w in wlogs] == pytest.approx([h["loss"] for h in tlogs], rel=1e-6)


def test_predict_without_labels(runs):
    """Inputs without labels capture another graph on the same weights; predictions come member
    dim last, member i's equal to its plain Trainer's."""
    wide, _, alone, _ = runs
    test = [{k: v for k, v in d.items() if k != "labels"} for d in _data(10, 4)]
    out = wide.predict(test)
    assert out.predictions.shape == (10, 3, N)
    for i, (t, _) in enumerate(alone):
        want = t.predict(test).predictions
        assert abs(out.predictions[..., i] - want).max() <= 1e-9 * abs(want).max()


def test_one_capture_per_mode_for_the_loops_inputs(tmp_path, monkeypatch):
    """Note [Build the graph the loop runs]: the graph built at construction takes the batch as
    the training loop gives it (with num_items_in_batch), so training and evaluation run it: one
    train and one eval graph captured (a graph of the collated batch alone made the loop capture
    both modes twice), and the members still match their plain Trainer runs."""
    from wide_compiler.fx import pipeline

    compiled = []
    run_cached = pipeline.run_cached
    counted = lambda c: compiled.append(c.training) or run_cached(c)  # noqa: E731
    # compile_members' (the train graph) and the model's (the other mode's graph: it imports it when it compiles)
    monkeypatch.setattr(pipeline, "run_cached", counted)
    train, evals = _data(16, 0), _data(6, 1)
    args = _args(tmp_path, max_steps=2, learning_rate=1e-2)
    wide = WideTrainer(model=[_member(i) for i in range(2)], args=args, train_dataset=train, eval_dataset=evals,
                       wide_config=wc.WideConfig.fast())  # compiled at once (not deferred)
    wide.train()
    metrics = wide.evaluate()
    assert sorted(compiled) == [False, True] and len(wide.model._graphs) == 1, compiled
    for i in range(2):
        t = transformers.Trainer(model=_member(i), args=dataclasses.replace(args, output_dir=str(tmp_path / f"a{i}")),
                                 train_dataset=train, eval_dataset=evals)
        t.train()
        got, want = wide.model.member(i).state_dict(), t.model.state_dict()
        assert max(_rel(got[k], want[k]) for k in want if want[k].is_floating_point()) <= 1e-6
        assert metrics[f"eval_loss_member_{i}"] == pytest.approx(t.evaluate()["eval_loss"], rel=1e-6)


class _Masked(torch.nn.Module):
    """BERT's mask pattern: attention_mask.to(device, torch.bool), a device given positionally."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x, mask):
        return self.fc(x) * mask.to(x.device, torch.bool).unsqueeze(-1)


def test_a_positional_device_runs_on_meta_tensors(monkeypatch):
    """Note [Rank check on meta tensors] (fx/widen.py): aten.to.device(mask, cpu, bool) stopped the
    meta run ("Cannot copy out of meta tensor"), so every BERT classifier with an attention mask
    paid the fake run; its device now becomes meta like a device= keyword."""
    from wide_compiler.fx import widen

    ran = []
    monkeypatch.setattr(widen, "_fake_run", lambda *args, **kwargs: ran.append(1))
    models = [_Masked() for _ in range(2)]
    x, mask = torch.randn(3, 4), torch.tensor([1, 0, 1])
    wide = wc.compile(models, (x, mask), config=wc.WideConfig.fast())
    assert not ran
    xs, masks = torch.randn(2, 3, 4), torch.tensor([[1, 0, 1], [0, 1, 1]])
    torch.testing.assert_close(wide(xs, masks), torch.stack([m(xs[i], masks[i]) for i, m in enumerate(models)]))


@pytest.mark.parametrize("switch", [False, True])
def test_a_short_run_never_compiles_and_a_long_one_switches_exactly(tmp_path, monkeypatch, switch):
    """Note [Running the members until compiling pays] (model_deferred.py): by default a WideTrainer
    run too short to earn a capture back runs each member's own program (nothing captured), and one
    that earns it (here: a compile made to look free) compiles the train graph after the measured
    calls and goes on fused; either way every member ends where its plain Trainer run does."""
    from wide_compiler import model_deferred

    if switch:
        monkeypatch.setattr(model_deferred, "COLD_SECONDS", 0.0)
        monkeypatch.setattr(model_deferred, "COLD_SECONDS_PER_MODULE", 0.0)
        monkeypatch.setattr(model_deferred, "WARM_SECONDS", 0.0)
    train = _data(24, 0)
    args = _args(tmp_path, max_steps=4, learning_rate=1e-2)
    wide = WideTrainer(model=[_member(i) for i in range(2)], args=args, train_dataset=train)
    wide.train()
    assert wide.model.wide.compiled_modes() == (["train"] if switch else [])
    for i in range(2):
        t = transformers.Trainer(model=_member(i), args=dataclasses.replace(args, output_dir=str(tmp_path / f"a{i}")),
                                 train_dataset=train)
        t.train()
        got, want = wide.model.member(i).state_dict(), t.model.state_dict()
        assert max(_rel(got[k], want[k]) for k in want if want[k].is_floating_point()) <= 1e-6
