"""Every text backbone of the installed keras-hub under data 2 x tensor 2
(tests/every_backbone_common.py finds them and builds each from small
arguments, in its task model).

Each family is created under `TensorParallelStrategy` and its fullest
device must hold Megatron's share of the bytes within 5%, counted from
every per-device variable; families in `TRAINED` also train 4 SGD steps
against one device from the same initial weights and batches. A family
tfpar refuses must raise the `ValueError` of `REFUSED`; one that splits
short of Megatron's share must keep exactly the weights `WHOLE` names
whole. A family keras-hub adds in an upgrade is in no table: it must
split like Megatron and is trained in every run.

Print the table of docs/keras_hub.md: `TFPAR_TEST_FULL=1
PYTHONPATH=. python -m pytest -q -s tests/test_keras_hub_every_backbone.py
-p no:cacheprovider | grep '^| '`.
"""

import datetime
import os
import re

import pytest

import every_backbone_common as common
import hub_common
import suite_scope
from tfpar.tensor_parallel import families

FAMILIES = common.text_backbones()

# Refused at creation with a ValueError naming the reason.
_SCORES = (r"Layer '{}' \({}\) returned [23] values \(attention scores\?\); "
           r"tensor parallelism computes the attention output")
_EXPERTS = r"tfpar has no built-in plan for layer 'experts' \({}\)"
_QUERY_GATE = (r"'num_key_value_heads' = 2 looks like a head count, but "
               r"tracing found 4 query and 1 key/value heads")
REFUSED = {
    "T5Backbone": r"\(T5MultiHeadAttention\) .* weight 'self_attention/"
                  r"embeddings', which tracing cannot place",
    "XLNetBackbone": r"\(TwoStreamRelativeAttention\) has weight .*"
                     r"outside its projections",
    "DebertaV3Backbone": r"'rel_embedding/rel_embedding' .* would stay "
                         r"replicated",
    "WhisperBackbone": r"'encoder_token_embedding_conv_layer_1/kernel' .* "
                       r"would stay replicated",
    "MoonshineBackbone": r"'conv2/kernel' .* would stay replicated",
    "RWKV7Backbone": r"'RWKV_TIME_MIX' \(RWKV7TimeMix\)",
    "GptOssBackbone": r"\(GptOssAttention\) .* weight '.*/sinks', which "
                      r"tracing cannot place",
    "Gemma4Backbone": r"\(Gemma4TextAttention\) .* scores have shape "
                      r"\(None, 2, 2, None, None\), not \[batch, heads",
    "Qwen3_5Backbone": _QUERY_GATE,
    "Qwen3_5MoeBackbone": _QUERY_GATE,
    "T5GemmaBackbone": _SCORES.format("self_attention", "T5GemmaAttention"),
    "T5Gemma2Backbone": _SCORES.format("self_attention", "T5Gemma2Attention"),
    "Gemma3nBackbone": _SCORES.format("attention", "Gemma3nTextAttention"),
    "PaliGemmaBackbone": _SCORES.format("multi_head_attention",
                                        "PaliGemmaVitAttention"),
    "MixtralBackbone": _EXPERTS.format("MixtralMoeExperts"),
    "QwenMoeBackbone": _EXPERTS.format("QwenMoeExperts"),
    "Qwen3MoeBackbone": _EXPERTS.format("Qwen3MoeExperts"),
}
# Split, but with these backbone kernels whole on every device, which
# Megatron's share counts halved.
WHOLE = {
    # The embedding projection (embedding_dim -> hidden): a lone Dense,
    # which the built-in plan replicates.
    "AlbertBackbone": r"embedding_projection/kernel",
    "FNetBackbone": r"embedding_projection/kernel",
    # AltUp's and the per-layer inputs' projections: lone Dense layers,
    # which the built-in plan replicates.
    "Gemma3nBackbone": r".*(altup|per_layer)[a-z_0-9/]*/kernel",
    # The image projection (vision width -> text width): a lone Dense.
    "PaliGemmaBackbone": r"image_classifier/kernel",
}
# Not built here: their inputs are not text the generator makes.
NOT_BUILT = {
    "PARSeqBackbone": "requires \\['image_encoder', 'max_label_length'\\]",
    "VideoPrismBackbone": "requires \\['num_frames', 'patch_size'\\]",
}
# The text backbones of keras-hub 0.32, for which this file was written:
# a family not here is new, and trains in every run.
KNOWN = frozenset(set(REFUSED) | set(WHOLE) | set(NOT_BUILT) | {
    "BartBackbone", "BloomBackbone", "CLIPTextEncoder", "DistilBertBackbone",
    "ESMBackbone", "EdRecBackbone", "ElectraBackbone", "FalconBackbone",
    "GPT2Backbone", "GPTNeoXBackbone", "Gemma3Backbone", "Gemma3nBackbone",
    "GemmaBackbone",
    "Llama3Backbone", "LlamaBackbone", "MetaCLIP2TextEncoder",
    "MistralBackbone", "OPTBackbone", "Phi3Backbone", "Qwen3Backbone",
    "QwenBackbone", "RobertaBackbone", "RoformerV2Backbone",
    "SigLIPTextEncoder", "SmolLM3Backbone", "T5Gemma2Backbone",
    "T5GemmaBackbone", "XLMRobertaBackbone"})

_SPLIT = sorted(n for n in FAMILIES if n not in REFUSED and
                n not in NOT_BUILT)
# The default run trains ROTATION_SIZE known families, a different window
# each day (TFPAR_TEST_ROTATION picks one), and every new family.
ROTATION_SIZE = 5
ROTATION = int(os.environ.get("TFPAR_TEST_ROTATION",
                              datetime.date.today().toordinal()))
_known_split = [n for n in _SPLIT if n in KNOWN]
_window = {_known_split[(ROTATION * ROTATION_SIZE + i) % len(_known_split)]
           for i in range(min(ROTATION_SIZE, len(_known_split)))}
TRAINED = set(suite_scope.cases(
    [n for n in _SPLIT if n in _window or n not in KNOWN],
    [n for n in _SPLIT if n not in _window and n in KNOWN]))


def test_tables_name_only_installed_text_backbones():
  """Every family is enumerated and each table entry is one of them."""
  assert len(FAMILIES) >= 40, sorted(FAMILIES)
  for table in (REFUSED, WHOLE, NOT_BUILT, common.CONFIGS, KNOWN):
    assert set(table) <= set(FAMILIES), sorted(set(table) - set(FAMILIES))


def _attention_layout(model):
  """How the model's attention layers are split: by tracing, by
  `families.py`'s table, or stock `MultiHeadAttention`."""
  found = set()
  for layout in model._tfpar_layouts:  # pylint: disable=protected-access
    if layout.kind == "MultiHeadAttention":
      found.add("MultiHeadAttention")
    elif layout.kind == "AttentionHeads":
      family = families.table_family_of(layout.layer)
      found.add("tracing" if family is None else "MultiHeadAttention"
                if family.class_name == "MultiHeadAttention" else "table")
  return " + ".join(sorted(found)) or "no attention split"


def _task_name(task):
  return task.__name__ if task is not None else "backbone + head"


def _whole_on_every_device(model, reference, pattern):
  """Paths of the backbone weights matching `pattern`, each checked whole
  on every device."""
  paths = [w.path for w in reference.weights
           if re.fullmatch(pattern, w.path) and
           w.path in reference.backbone_weight_paths]
  assert paths, pattern
  for path in paths:
    whole = sum(hub_common.bytes_by_device(reference, path).values())
    held = hub_common.bytes_by_device(model, path)
    assert len(held) == 4 and set(held.values()) == {whole}, (path, held)
  return paths


def _split_and_train(name, train):
  """Creates the family under data 2 x tensor 2, checks its bytes and,
  when `train`, trains it against one device; returns its table row."""
  cls = FAMILIES[name]
  model, _ = common.sharded(cls)
  reference = common.reference(cls)
  whole = _whole_on_every_device(model, reference, WHOLE[name]) if (
      name in WHOLE) else ()
  fullest = max(hub_common.bytes_by_device(model).values())
  total = sum(hub_common.bytes_by_device(reference).values())
  megatron = common.megatron_share(reference)
  share = common.megatron_share(reference, whole)
  assert fullest <= share * 1.05, (fullest, share)
  worst = "not trained (rotation)"
  if train:
    difference = common.train_both(reference, model)
    worst = f"{difference:.1e}"
    if difference >= 1e-5:
      # Ill-conditioned at this size: within a tenth of what one device's
      # own rounding (a 1e-7 nudge of every weight) makes of it.
      nudged = common.nudged_difference(cls)
      assert difference < nudged / 10, (difference, nudged)
      worst += f" (1e-7 nudge on one device: {nudged:.1e})"
  return (f"{_task_name(common.task_class(cls))} | "
          f"{_attention_layout(model)} | {worst} | {fullest:,} / {total:,} "
          f"= {fullest / total:.3f} | {megatron / total:.3f} "
          f"({fullest / megatron:.3f})" + (
              f"; {share / total:.3f} ({fullest / share:.3f}) with "
              f"{', '.join(p.rsplit('/', 1)[0] for p in whole)} whole"
              if whole else ""))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_text_backbone_splits_like_megatron(name):
  cls = FAMILIES[name]
  if name in NOT_BUILT:
    with pytest.raises(ValueError, match=NOT_BUILT[name]):
      common.build(cls)
    print(f"\n| {name} | | not built: {NOT_BUILT[name]} | | | |")
    return
  if name in REFUSED:
    # At creation, or in the first step (an attention returning more than
    # its output): training runs whatever the rotation.
    with pytest.raises(ValueError, match=REFUSED[name]) as refusal:
      _split_and_train(name, train=True)
    reason = re.search(REFUSED[name], str(refusal.value)).group(0)
    print(f"\n| {name} | {_task_name(common.task_class(cls))} | refused: "
          f"{reason} | | | |")
    return
  print(f"\n| {name} | {_split_and_train(name, name in TRAINED)} |")
