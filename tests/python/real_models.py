"""The real-model catalog: tiny random-config models from ``transformers`` and ``diffusers``, as a
user would take them (default options: decoders keep ``use_cache=True``), with every dropout at 0
so train mode is deterministic and can be compared member by member.

``test_real_models.py`` checks each one with :func:`wide_compiler.testing.check_compile`; run this
file to print the README's "Models known to work" table from the same catalog::

    .venv/bin/python tests/python/real_models.py            # markdown table on stdout
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class RealModel:
    name: str              # the README's model column
    library: str           # "transformers" / "diffusers"
    make: Callable[[], nn.Module]
    args: Callable[[], tuple]
    kwargs: Callable[[], dict[str, Any]] = dict
    what: str = ""         # what the case exercises
    # float64 where float32 gradient sums over many conv positions round differently between the
    # grouped conv and N convs (up to 2e-4 absolute in float32; members agree to 1e-13 in float64)
    dtype: torch.dtype = torch.float32
    # a regex of the refusal of its train graph, where it has one (checked); it is compared in eval only
    train_refused: str = ""


def _ids(b: int = 2, s: int = 8, v: int = 64) -> torch.Tensor:
    return torch.randint(3, v, (b, s), generator=torch.Generator().manual_seed(s))


def _img(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


_ENC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_DEC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=1, bos_token_id=2, eos_token_id=2)
_AUDIO = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
              num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
              feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)
_SEQ2SEQ = dict(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2,
                decoder_start_token_id=2)


def _wav2vec2(config: Any) -> nn.Module:
    """In train mode its feature extractor sets ``requires_grad`` on a non-leaf view of the
    input, which fails in plain PyTorch whenever the input itself requires grad (as the
    input-gradient check makes it); the flag only serves gradient checkpointing, so it is off."""
    from transformers import Wav2Vec2Model

    model = Wav2Vec2Model(config)
    model.feature_extractor._requires_grad = False
    return model


def _transformers() -> list[RealModel]:
    import transformers as T

    def tf(name, cls, config, args, kwargs=dict, what="", dtype=torch.float32, train_refused=""):
        return RealModel(name, "transformers", lambda: cls(config()), args, kwargs, what, dtype, train_refused)

    dec_in = lambda: {"decoder_input_ids": _ids(2, 5)}  # noqa: E731
    return [
        tf("BertModel", T.BertModel, lambda: T.BertConfig(**_ENC), lambda: (_ids(),), what="encoder"),
        tf("RobertaModel", T.RobertaModel, lambda: T.RobertaConfig(**_ENC, pad_token_id=1), lambda: (_ids(),),
           what="encoder, position ids from the padding mask"),
        tf("AlbertModel", T.AlbertModel, lambda: T.AlbertConfig(**_ENC, embedding_size=16), lambda: (_ids(),),
           what="encoder, one layer shared by every depth"),
        tf("ElectraForPreTraining", T.ElectraForPreTraining, lambda: T.ElectraConfig(**_ENC, embedding_size=16),
           lambda: (_ids(),), what="encoder with a head"),
        tf("DebertaV2Model", T.DebertaV2Model,
           lambda: T.DebertaV2Config(**_ENC, relative_attention=True, position_buckets=8, max_relative_positions=16,
                                     pos_att_type=["p2c", "c2p"]),
           lambda: (_ids(),), what="disentangled relative attention (gather by a position index)"),
        tf("ConvBertModel", T.ConvBertModel, lambda: T.ConvBertConfig(**_ENC, embedding_size=32), lambda: (_ids(),),
           what="span convolution: unfold (im2col)"),
        tf("FunnelModel", T.FunnelModel,
           lambda: T.FunnelConfig(vocab_size=64, d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1],
                                  num_decoder_layers=1, hidden_dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0),
           lambda: (_ids(),), what="pooling between blocks, relative positions"),
        tf("XLNetModel", T.XLNetModel,
           lambda: T.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=0.0,
                                 pad_token_id=1, bos_token_id=2, eos_token_id=2),
           lambda: (_ids(),), what="two-stream attention, sinusoidal positions"),
        tf("CLIPTextModel", T.CLIPTextModel,
           lambda: T.CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=16, pad_token_id=1,
                                    bos_token_id=2, eos_token_id=63),
           lambda: (_ids(),), what="pooled at each sequence's end-of-text token (a per-member index)"),
        tf("GPT2LMHeadModel", T.GPT2LMHeadModel,
           lambda: T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=2, eos_token_id=2),
           lambda: (_ids(),), what="decoder, tied LM head, DynamicCache output"),
        tf("LlamaForCausalLM", T.LlamaForCausalLM, lambda: T.LlamaConfig(**_DEC), lambda: (_ids(),),
           what="rotary no-grad/autocast regions, GQA, DynamicCache output"),
        tf("LlamaForCausalLM (use_cache=False)", T.LlamaForCausalLM, lambda: T.LlamaConfig(**_DEC, use_cache=False),
           lambda: (_ids(),), what="decoder without a cache"),
        tf("MistralForCausalLM", T.MistralForCausalLM, lambda: T.MistralConfig(**_DEC), lambda: (_ids(),),
           what="rotary decoder, sliding-window config"),
        tf("Qwen2ForCausalLM", T.Qwen2ForCausalLM, lambda: T.Qwen2Config(**_DEC), lambda: (_ids(),),
           what="rotary decoder, q/k/v biases"),
        tf("GemmaForCausalLM", T.GemmaForCausalLM, lambda: T.GemmaConfig(**_DEC, head_dim=8), lambda: (_ids(),),
           what="rotary decoder, scaled embeddings, RMSNorm (1 + w)"),
        tf("PhiForCausalLM", T.PhiForCausalLM,
           lambda: T.PhiConfig(**{k: v for k, v in _DEC.items() if k != "num_key_value_heads"}, resid_pdrop=0.0,
                               embd_pdrop=0.0, attention_dropout=0.0),
           lambda: (_ids(),), what="partial rotary, parallel attention/MLP"),
        tf("FalconForCausalLM", T.FalconForCausalLM,
           lambda: T.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=2, eos_token_id=2),
           lambda: (_ids(),), what="multi-query attention"),
        tf("BloomForCausalLM", T.BloomForCausalLM,
           lambda: T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                                 attention_dropout=0.0, bos_token_id=2, eos_token_id=2, pad_token_id=1),
           lambda: (_ids(),), what="ALiBi position biases; its GeLU, a custom autograd.Function, by the built-in "
           "wide form (its own backward runs)"),
        tf("GPTNeoXForCausalLM", T.GPTNeoXForCausalLM,
           lambda: T.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0,
                                   attention_dropout=0.0, bos_token_id=2, eos_token_id=2),
           lambda: (_ids(),), what="rotary, parallel residual"),
        tf("OPTForCausalLM", T.OPTForCausalLM,
           lambda: T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                               attention_dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2),
           lambda: (_ids(),), what="learned positions from the attention mask's cumsum"),
        tf("T5ForConditionalGeneration", T.T5ForConditionalGeneration,
           lambda: T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                              dropout_rate=0.0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2),
           lambda: (_ids(),), dec_in, what="encoder-decoder, shared embedding (tied), EncoderDecoderCache output"),
        tf("BartForConditionalGeneration", T.BartForConditionalGeneration,
           lambda: T.BartConfig(**_SEQ2SEQ, max_position_embeddings=64), lambda: (_ids(),), dec_in,
           what="encoder-decoder, tied embeddings and head"),
        tf("WhisperModel", T.WhisperModel,
           lambda: T.WhisperConfig(**_SEQ2SEQ, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                                   suppress_tokens=[], begin_suppress_tokens=[]),
           lambda: (_img(2, 8, 16),), dec_in, what="audio encoder-decoder: conv front end, float features"),
        tf("Wav2Vec2Model", _wav2vec2, lambda: T.Wav2Vec2Config(**_AUDIO), lambda: (_img(2, 400),),
           what="audio: conv feature extractor, weight-norm positional conv"),
        tf("ViTModel", T.ViTModel,
           lambda: T.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0),
           lambda: (_img(2, 3, 16, 16),), what="ViT: patch conv, CLS token"),
        tf("SwinModel", T.SwinModel,
           lambda: T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                window_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                drop_path_rate=0.0),
           lambda: (_img(2, 3, 32, 32),), what="windows, relative-position bias by an index buffer"),
        tf("SegformerForSemanticSegmentation", T.SegformerForSemanticSegmentation,
           lambda: T.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                     hidden_sizes=[8, 16], num_attention_heads=[1, 2], decoder_hidden_size=16,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     drop_path_rate=0.0, classifier_dropout_prob=0.0),
           lambda: (_img(2, 3, 32, 32),), what="efficient attention, upsampling decode head"),
        tf("ConvNextModel", T.ConvNextModel,
           lambda: T.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2),
           lambda: (_img(2, 3, 32, 32),), what="depthwise conv, channels-last LayerNorm, layer scale", dtype=torch.float64),
        tf("ResNetModel", T.ResNetModel,
           lambda: T.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]),
           lambda: (_img(2, 3, 32, 32),), what="conv + BatchNorm (running statistics)", dtype=torch.float64),
        tf("MobileViTModel", T.MobileViTModel,
           lambda: T.MobileViTConfig(num_channels=3, image_size=32, patch_size=2, hidden_sizes=[16, 16, 16],
                                     neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16], num_attention_heads=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     classifier_dropout_prob=0.0),
           lambda: (_img(2, 3, 32, 32),), what="conv + attention over unfolded patches", dtype=torch.float64),
    ]


def _diffusers() -> list[RealModel]:
    from diffusers import AutoencoderKL, UNet2DConditionModel, UNet2DModel

    return [
        RealModel("UNet2DModel", "diffusers",
                  lambda: UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                      block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                      up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
                                      attention_head_dim=8),
                  lambda: (_img(2, 3, 16, 16), torch.tensor([10])), what="timestep input, attention blocks",
                  dtype=torch.float64),
        RealModel("UNet2DConditionModel", "diffusers",
                  lambda: UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                               block_out_channels=(16, 32),
                                               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                               cross_attention_dim=16, norm_num_groups=8, attention_head_dim=4),
                  lambda: (_img(2, 4, 8, 8), torch.tensor([10]), _img(2, 5, 16)),
                  what="cross-attention to text states, timestep", dtype=torch.float64),
        RealModel("AutoencoderKL", "diffusers",
                  lambda: AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
                                        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                                        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
                                        block_out_channels=(8, 16), layers_per_block=1),
                  lambda: (_img(2, 3, 16, 16),), what="VAE: GroupNorm, mid-block attention", dtype=torch.float64),
    ]


def catalog() -> list[RealModel]:
    """Every real model whose library is installed."""
    out = []
    for load in (_transformers, _diffusers):
        try:
            out += load()
        except ImportError:
            pass
    return out


def members(case: RealModel, n: int = 3) -> list[nn.Module]:
    """``n`` independently initialised members (seeded) in the case's dtype; no mode switch."""
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(case.make().to(case.dtype))
    return out


def sample(case: RealModel) -> tuple[tuple, dict[str, Any]]:
    """One member's positional and keyword inputs, floating ones in the case's dtype."""
    cast = lambda t: t.to(case.dtype) if t.is_floating_point() else t  # noqa: E731
    return tuple(cast(a) for a in case.args()), {k: cast(v) for k, v in case.kwargs().items()}


def table_row(case: RealModel, wide: Any) -> str:
    """One markdown row: model, library, what it exercises, dtype checked in, distinct ops widened
    (train graph; eval graph where the train graph is refused), fallbacks."""
    wg = wide._graph_for(not case.train_refused)
    fallbacks = ", ".join(sorted({f["op"] for f in wg.fallbacks})) or "none"
    dtype = str(case.dtype).removeprefix("torch.")
    return f"| {case.name} | {case.library} | {case.what} | {dtype} | {len(wg.rules_used)} | {fallbacks} |"


def main() -> None:
    import warnings

    import wide_compiler as wc

    warnings.filterwarnings("ignore")
    print("| model | library | what it exercises | checked in | ops widened | fallbacks |")
    print("|---|---|---|---|---:|---|")
    for case in catalog():
        models = [m.train(not case.train_refused) for m in members(case)]
        args, kwargs = sample(case)
        wide = wc.compile(models, args, sample_kwargs=kwargs, strict=True, config=wc.WideConfig.fast())
        print(table_row(case, wide), flush=True)


if __name__ == "__main__":
    sys.exit(main())
