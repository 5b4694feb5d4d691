"""Small byte-level BPE tokenizers trained at test time (nothing downloaded) with each family's
special tokens and chat template, so a tiny checkpoint folder is a whole servable model."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = ["The capital of France is Paris.", "What is the capital of France?", "Write a haiku about the sea.",
          "List three fruits that are red: apple, cherry, strawberry.", "def f(x): return x ** 2"] * 4
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
         "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# family -> (special tokens, bos, eos_token of tokenizer_config, chat template)
STYLES = {
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", LLAMA3),
    # Gemma's ids: <pad> 0, <eos> 1, <bos> 2; the turn's end declared by tokenizer_config
    "gemma": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>", GEMMA),
}


def build_tokenizer(style: str, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style, as Qwen and Llama 3) of at most vocab_size ids, specials first."""
    specials, bos, eos, template = STYLES[style]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos,
                                 pad_token=specials[0], clean_up_tokenization_spaces=False)
    hf.chat_template = template
    return hf
