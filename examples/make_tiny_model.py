"""Build tiny, offline, deterministic assets for the example training scripts.

    python examples/make_tiny_model.py --out /tmp/tiny

creates (nothing is downloaded):

    DIR/model/      tiny Llama-style causal LM (2 layers, hidden 32) + tokenizer
    DIR/teacher/    a different tiny causal LM (3 layers, other seed), same tokenizer/vocab
    DIR/data/pt.jsonl        {"text": ...}                          (pre-training)
    DIR/data/sft.jsonl       {"messages": [user, assistant]}         (SFT)
    DIR/data/prompts.jsonl   {"prompt": [user], "answer": ...}       (GRPO)
    DIR/data/gkd.jsonl       {"messages": [system, user, assistant]} (GKD)

The tokenizer is a word-level tokenizer whose vocabulary is built from the (synthetic) corpus,
wrapped in `PreTrainedTokenizerFast` with bos/eos/pad/unk tokens and a small chat template.
Running it again on a complete DIR does nothing.

    python examples/make_tiny_model.py --vllm --out /tmp/tiny-vllm

builds the same files with shapes vLLM can serve (its CPU attention needs a head size of 32, 64, 80, ...; the default
models' 8 crashes it): hidden 64 in 2 heads of 32. A student and a teacher, still tiny (well under 1 MB each).
"""

import argparse
import json
import os
import random

NUMBERS = [str(i) for i in range(21)]
NOUNS = ["cat", "dog", "bird", "fish", "tree", "house", "car", "book", "apple", "river"]
ADJECTIVES = ["big", "small", "red", "blue", "green", "old", "new", "happy", "quiet", "fast"]
VERBS = ["sees", "likes", "finds", "wants", "has", "makes"]
FILLER = ["the", "a", "is", "what", "plus", "minus", "answer", "question", "please", "add", "and",
          "yes", "no", "ok", "you", "are", "helpful", "assistant", "tell", "me", "about", "it", ".", "?", ","]
SPECIAL = {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
FILES = ["model/config.json", "model/tokenizer.json", "teacher/config.json", "teacher/tokenizer.json",
         "data/pt.jsonl", "data/sft.jsonl", "data/prompts.jsonl", "data/gkd.jsonl"]
N_ROWS = 64


def sentence(rng):
    a, n, v, b, m = (rng.choice(x) for x in (ADJECTIVES, NOUNS, VERBS, ADJECTIVES, NOUNS))
    return f"the {a} {n} {v} a {b} {m} ."


def arithmetic(rng):
    x, y = rng.randint(0, 10), rng.randint(0, 10)
    if rng.random() < 0.5:
        return f"what is {x} plus {y} ?", f"{x} plus {y} is {x + y} .", str(x + y)
    x, y = max(x, y), min(x, y)
    return f"what is {x} minus {y} ?", f"{x} minus {y} is {x - y} .", str(x - y)


def make_data(seed):
    rng = random.Random(seed)
    pt, sft, prompts, gkd = [], [], [], []
    for _ in range(N_ROWS):
        pt.append({"text": " ".join(sentence(rng) if rng.random() < 0.5 else arithmetic(rng)[1] for _ in range(3))})
        q, a, _ = arithmetic(rng)
        sft.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        q, _, ans = arithmetic(rng)
        prompts.append({"prompt": [{"role": "user", "content": q}], "answer": ans})
        q, a, _ = arithmetic(rng) if rng.random() < 0.5 else ("tell me about it .", sentence(rng), None)
        gkd.append({"messages": [{"role": "system", "content": "you are a helpful assistant ."},
                                 {"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return {"pt": pt, "sft": sft, "prompts": prompts, "gkd": gkd}


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL.values()) + ROLE_TOKENS + sorted(set(NUMBERS + NOUNS + ADJECTIVES + VERBS + FILLER))
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL.values()) + ROLE_TOKENS)
    bos = SPECIAL["bos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL["bos"],
        eos_token=SPECIAL["eos"],
        pad_token=SPECIAL["pad"],
        unk_token=SPECIAL["unk"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )


# (hidden_size, intermediate_size, attention heads, kv heads): head size 8 by default, 32 for vLLM.
SHAPES = {"default": (32, 64, 4, 2), "vllm": (64, 128, 2, 1)}


def make_model(tokenizer, num_layers, seed, shape="default"):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    hidden, intermediate, heads, kv_heads = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    parser.add_argument("--vllm", action="store_true", help="shapes vLLM can serve (head size 32; use its own --out)")
    args = parser.parse_args()
    out = os.path.abspath(args.out)

    if not args.force and all(os.path.exists(os.path.join(out, f)) for f in FILES):
        print(f"tiny assets already present in {out}")
    else:
        tokenizer = make_tokenizer()
        for name, num_layers, seed in (("model", 2, args.seed), ("teacher", 3, args.seed + 1)):
            path = os.path.join(out, name)
            make_model(tokenizer, num_layers, seed, "vllm" if args.vllm else "default").save_pretrained(path)
            tokenizer.save_pretrained(path)
        os.makedirs(os.path.join(out, "data"), exist_ok=True)
        for name, rows in make_data(args.seed).items():
            tmp = os.path.join(out, "data", f"{name}.jsonl.tmp")
            with open(tmp, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            os.replace(tmp, os.path.join(out, "data", f"{name}.jsonl"))  # written last: marks DIR complete

    print(f"model:    {out}/model")
    print(f"teacher:  {out}/teacher")
    print(f"datasets: {out}/data/{{pt,sft,prompts,gkd}}.jsonl")


if __name__ == "__main__":
    main()
