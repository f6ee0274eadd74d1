"""Make tests/fixtures/dflash: a tiny Qwen3 target and a DFlash drafter in z-lab's layout, with outputs
of z-lab's own PyTorch model code (https://github.com/z-lab/dflash, dflash/model.py) as golden files.

Writes
* ``dflash/target/``  -- a random Qwen3ForCausalLM (float32, 4 layers, head_dim 24 != 64 / 4 heads, GQA),
  ``save_pretrained`` output;
* ``dflash/drafter/`` -- a random ``DFlashDraftModel`` (2 layers, block_size 8, target_layer_ids [0, 2],
  mask_token_id 127), ``save_pretrained`` output: z-lab's layout;
* ``golden/dflash.npz`` -- ``prompt`` [P], ``first_token`` (the target's greedy token after it),
  ``first_block_logits`` [block_size - 1, V] (the draft logits of the first block, anchored at that
  token, from one drafter forward), ``block_logits`` [steps, block_size - 1, V] (every block's draft
  logits inside ``dflash_generate``, recorded by a forward hook: blocks after the first run on the
  drafter's cache) and ``greedy`` (``dflash_generate``'s greedy output after the prompt, exactly
  ``NEW_TOKENS`` tokens, checked equal to transformers' greedy generate).

Needs torch, transformers (written with torch 2.13.0 and transformers 4.57.1, which z-lab pins), numpy and a checkout of
z-lab/dflash; torch is not a specjax dependency, so from a separate virtual environment:

    python scripts/make_dflash_fixtures.py --dflash-src PATH/TO/z-lab/dflash [--out tests/fixtures]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128
BLOCK_SIZE = 8
MASK_TOKEN_ID = VOCAB - 1
TARGET_LAYER_IDS = [0, 2]
PROMPT_LENGTH = 7
NEW_TOKENS = 24
SEED = 0

_QWEN3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=24, max_position_embeddings=128, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
              use_sliding_window=False, bos_token_id=1, eos_token_id=2)


def randomise_norms(model, std=0.1):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0, std)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dflash-src", type=Path, required=True, help="a checkout of z-lab/dflash")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    args = parser.parse_args()
    sys.path.insert(0, str(args.dflash_src))
    from dflash.model import DFlashDraftModel, dflash_generate, extract_context_feature

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    target_config = transformers.Qwen3Config(**_QWEN3, num_hidden_layers=4, initializer_range=0.2,
                                             dtype="float32", attn_implementation="eager")
    target = transformers.Qwen3ForCausalLM(target_config).eval()
    randomise_norms(target)

    draft_config = transformers.Qwen3Config(**_QWEN3, num_hidden_layers=2, initializer_range=0.5, dtype="float32",
                                            attn_implementation="eager")
    draft_config.architectures = ["DFlashDraftModel"]
    draft_config.block_size = BLOCK_SIZE
    draft_config.num_target_layers = target_config.num_hidden_layers
    draft_config.dflash_config = {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": TARGET_LAYER_IDS}
    drafter = DFlashDraftModel(draft_config).eval()
    randomise_norms(drafter)

    rng = np.random.default_rng(SEED)
    prompt = torch.as_tensor(rng.integers(3, VOCAB - 1, PROMPT_LENGTH), dtype=torch.long)[None]
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        first_token = out.logits[0, -1].argmax()
        context = extract_context_feature(out.hidden_states, drafter.target_layer_ids)
        block = torch.full((1, BLOCK_SIZE), MASK_TOKEN_ID, dtype=torch.long)
        block[0, 0] = first_token
        positions = torch.arange(PROMPT_LENGTH + BLOCK_SIZE)[None]
        hidden = drafter(target_hidden=context, noise_embedding=target.model.embed_tokens(block),
                         position_ids=positions, is_causal=False)
        first_block_logits = target.lm_head(hidden[:, 1 - BLOCK_SIZE:])[0]
        recorded = []
        hook = drafter.register_forward_hook(lambda module, inputs, output: recorded.append(output[:, 1 - BLOCK_SIZE:]))
        result = dflash_generate(drafter, target, prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=None,
                                 temperature=0.0, return_stats=False)
        hook.remove()
        block_logits = torch.cat([target.lm_head(hidden) for hidden in recorded])
        greedy = result[0, PROMPT_LENGTH:PROMPT_LENGTH + NEW_TOKENS]
        # Exactly NEW_TOKENS tokens, EOS included: generate() must not take eos from the model's config.
        saved, target.generation_config = target.generation_config, transformers.GenerationConfig()
        reference = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, pad_token_id=0)
        target.generation_config = saved
    assert len(greedy) == NEW_TOKENS
    with torch.no_grad():  # the greedy golden is no near-tie: the top two logits apart by more than 1e-3
        top2 = target(reference.clone()).logits[0, PROMPT_LENGTH - 1:-1].topk(2, -1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > 1e-3, f"greedy margin {margin}"
    assert torch.equal(greedy, reference[0, PROMPT_LENGTH:]), "DFlash greedy output differs from the target's"
    torch.testing.assert_close(block_logits[0], first_block_logits)  # the first block: the same forward
    drafts = first_block_logits.argmax(-1)
    print(f"  first block drafts {drafts.tolist()}, target's greedy {greedy[:BLOCK_SIZE].tolist()}, "
          f"{len(block_logits)} blocks, min greedy margin {margin:.4f}")

    target_dir, drafter_dir = args.out / "dflash" / "target", args.out / "dflash" / "drafter"
    target.save_pretrained(target_dir)
    drafter.save_pretrained(drafter_dir)
    (args.out / "golden").mkdir(parents=True, exist_ok=True)
    np.savez(args.out / "golden" / "dflash.npz", prompt=prompt[0].numpy().astype(np.int32),
             first_token=np.int32(first_token), first_block_logits=first_block_logits.numpy().astype(np.float32),
             block_logits=block_logits.numpy().astype(np.float32), greedy=greedy.numpy().astype(np.int32))
    print(f"  wrote {target_dir}, {drafter_dir}, {args.out / 'golden' / 'dflash.npz'}")


if __name__ == "__main__":
    main()
