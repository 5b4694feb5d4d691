"""An input-grounded named workload: chats whose answers quote their input (code edits, rewrites,
quoting summaries), where prompt lookup (n-gram) speculation has something to find. Rendered with
the default model's chat template and tokenizer, so a name gives the same token ids everywhere that
tokenizer is."""

from __future__ import annotations

CODE = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for value in values:\n        total += (value - m) ** 2\n    return total / len(values)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def is_empty(self):\n        return not self.items\n",
    "def read_config(path):\n    config = {}\n    with open(path) as f:\n        for line in f:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
    "            key, value = line.split('=', 1)\n            config[key.strip()] = value.strip()\n    return config\n",
    "function fetchUser(id) {\n  return fetch('/api/users/' + id)\n    .then(function (response) {\n"
    "      return response.json();\n    })\n    .then(function (user) {\n      console.log(user.name);\n"
    "      return user;\n    });\n}\n",
]
CODE_TASKS = [
    "Add type hints to every function in this code and return the whole code:",
    "Rename the variable `total` to `acc` (or, if there is none, `items` to `elements`) and return the whole code:",
    "Add a docstring to each function and return the whole code:",
    "Rewrite this code in the same language, keeping every line, and add a comment above each function:",
]
TEXTS = [
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual reefs "
    "and 900 islands stretching for over 2,300 kilometres. The reef is located in the Coral Sea, off the coast "
    "of Queensland, Australia. It can be seen from outer space and is the world's biggest single structure made "
    "by living organisms. The reef is under threat from climate change, pollution and coral bleaching.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and "
    "water. It takes place in the chloroplasts, which contain chlorophyll, the pigment that absorbs light. "
    "Oxygen is released as a by-product. Almost all life on Earth depends on photosynthesis, directly or "
    "indirectly, because it is the main source of the energy that flows through food chains.",
    "The meeting is moved from Tuesday to Thursday at 10 am in room 4B. Please bring the quarterly report, the "
    "updated budget and your notes on the hiring plan. Anna will present the sales figures, Ben the product "
    "roadmap, and Carla the customer survey. Lunch will be served after the meeting in the main hall.",
    "To reset the router, unplug it from the power socket, wait thirty seconds, and plug it back in. Wait until "
    "the status light turns solid green, which can take up to two minutes. If the light stays orange, press the "
    "reset button on the back for ten seconds with a paper clip, then set up the network again from the app.",
]
TEXT_TASKS = [
    "Repeat the following text exactly, then list its key facts, quoting the sentences they come from:",
    "Rewrite the following text in the first person, keeping every sentence:",
    "Summarize the following text by quoting its three most important sentences word for word:",
    "Correct any mistakes in the following text and return the full corrected text:",
]
NUM_OUTPUT_TOKENS = 192


def grounded_chats() -> list[list[dict]]:
    """16 chats: each code snippet with each code task, each text with each text task (4 + 4 of each)."""
    chats = [f"{CODE_TASKS[i]}\n\n```\n{CODE[i]}```" for i in range(len(CODE))]
    chats += [f"{CODE_TASKS[(i + 1) % len(CODE_TASKS)]}\n\n```\n{CODE[i]}```" for i in range(len(CODE))]
    chats += [f"{TEXT_TASKS[i]}\n\n{TEXTS[i]}" for i in range(len(TEXTS))]
    chats += [f"{TEXT_TASKS[(i + 2) % len(TEXT_TASKS)]}\n\n{TEXTS[i]}" for i in range(len(TEXTS))]
    return [[{"role": "user", "content": content}] for content in chats]


def grounded_edits(model: str = "smollm2") -> list[dict]:
    """The chats as token ids, up to NUM_OUTPUT_TOKENS each, ending at EOS (past it: an invented new chat)."""
    from pagedserve.shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    return [{"prompt_token_ids": tokenizer.apply_chat_template(chat), "max_tokens": NUM_OUTPUT_TOKENS, "ignore_eos": False}
            for chat in grounded_chats()]
