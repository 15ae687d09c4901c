"""Tiny, offline stand-ins for real models and data, for tests and smoke runs.

Everything here is built in memory, deterministically, in well under a second,
without network access:

- :func:`make_tiny_tokenizer` — a *fast* byte-level BPE tokenizer (any text
  tokenizes, no unknown tokens, exact character offsets) with ChatML special
  tokens and a ChatML chat template like SmolLM2's, or a Llama-3-style template
  that embeds today's date (``date_in_template=True``).
- :func:`make_tiny_llama`, :func:`make_tiny_qwen2`, :func:`make_tiny_gemma`,
  :func:`make_tiny_gemma3` — randomly initialised causal LMs (float32, eval mode, eager attention,
  gradients off) whose vocabulary matches the tiny tokenizer.
- :func:`make_conversations` — synthetic labelled multi-agent
  :class:`~skafa.conversation.Conversation` objects with repeated task ids.

The models are random: they exercise shapes, positions and plumbing, not
accuracy.

Examples
--------
>>> from skafa.testing import make_tiny_tokenizer, make_tiny_llama, make_conversations
>>> tok = make_tiny_tokenizer()
>>> model = make_tiny_llama()
>>> convs = make_conversations(4)
>>> len(convs), tok.is_fast, model.config.num_hidden_layers
(4, True, 2)
"""

from __future__ import annotations

import functools

import numpy as np

from .conversation import Conversation, Turn

__all__ = [
    "make_site_features",
    "write_who_and_when",
    "CHATML_TEMPLATE",
    "LLAMA3_DATE_TEMPLATE",
    "SPECIAL_TOKENS",
    "make_tiny_tokenizer",
    "tiny_vocab_size",
    "make_tiny_llama",
    "make_tiny_qwen2",
    "make_tiny_gemma",
    "make_tiny_gemma3",
    "make_conversations",
    "register_tiny_model",
]

#: Special tokens of the tiny tokenizer, in id order (ids 0..6).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)

#: ChatML template in the style of SmolLM2-Instruct (default system message when
#: the conversation has none; no BOS token).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Llama-3-style template: starts with ``bos_token`` and writes today's date into
#: the system header. Pass ``date_string`` (e.g. through skafa's
#: ``chat_template_kwargs``) to pin it; otherwise ``strftime_now("%d %b %Y")``
#: is used, so the rendered prompt changes from day to day.
LLAMA3_DATE_TEMPLATE = (
    "{{ bos_token }}"
    "{% if date_string is not defined %}"
    "{% if strftime_now is defined %}{% set date_string = strftime_now('%d %b %Y') %}"
    "{% else %}{% set date_string = '01 Jan 2024' %}{% endif %}"
    "{% endif %}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system_message = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system_message = '' %}{% set rest = messages %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{ 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{ system_message + '<|eot_id|>' }}"
    "{% for message in rest %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Vocabulary of the synthetic conversations; also the tokenizer's training corpus,
# so prompts built from make_conversations compress to a few characters per token.
_SUBJECTS = ("the list", "the table", "the file", "the answer", "the total", "the query",
             "the search", "the result", "the code", "the plan", "the data", "the page")
_VERBS = ("checks", "reads", "computes", "returns", "prints", "finds", "updates", "sorts",
          "loads", "parses", "verifies", "writes")
_OBJECTS = ("every row", "the first value", "the last item", "a number", "the url",
            "the output", "each word", "the header", "the sum", "the count", "the year",
            "the name")
_TASKS = ("Find the sum of {a} and {b}.", "How many items are in a list of {a} and {b} items?",
          "Compute {a} plus {b} and report the total.",
          "Add {a} to {b} and print the answer.")
_EXTRA_CORPUS = (
    "You are a judge. Read a failed multi-agent run and find the step with the decisive error.",
    "Task: Expected answer: Conversation: Which step contains the decisive error?",
    "import numpy as np\ndef main():\n    x = [1, 2, 3]\n    print(sum(x))\n    return x\n",
    "exitcode: 0 (execution succeeded)\nCode output: 42\nTERMINATE",
    "I think we should verify this. Let me search the web for the answer. Plan: 1) look up "
    "the data 2) write the code 3) check the result. The answer is correct. That is wrong.",
    "Orchestrator (thought): WebSurfer: Assistant: user: system: assistant: ",
    "0123456789 ,.;:!?()[]{}<>'\"`-_=+*/\\|@#$%^&~ ",
)


def _corpus() -> list[str]:
    from .llm import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM

    rng = np.random.default_rng(1234)
    lines = list(_EXTRA_CORPUS) + [DEFAULT_SYSTEM, DEFAULT_INSTRUCTION] * 3
    for _ in range(300):
        a, b = (int(v) for v in rng.integers(2, 99, size=2))
        lines.append(f" [... {a}{b} characters omitted ...] ")
        lines.append(
            f"{_SUBJECTS[rng.integers(len(_SUBJECTS))].capitalize()} "
            f"{_VERBS[rng.integers(len(_VERBS))]} {_OBJECTS[rng.integers(len(_OBJECTS))]}. "
            f"I computed {a} + {b} = {a + b}. "
            + _TASKS[rng.integers(len(_TASKS))].format(a=a, b=b)
        )
    return lines


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def make_tiny_tokenizer(*, date_in_template: bool = False):
    """Build a small, fast, byte-level BPE tokenizer with a chat template.

    The tokenizer is trained in memory on a fixed built-in corpus (deterministic,
    offline, ~0.5 s the first time, cached afterwards; each call returns a new
    object). Byte-level BPE means any Unicode text tokenizes without unknown
    tokens, decodes back to itself, and ``return_offsets_mapping`` gives exact
    character offsets.

    Parameters
    ----------
    date_in_template : bool, default=False
        ``False``: ChatML template like SmolLM2's (:data:`CHATML_TEMPLATE`), no
        BOS token, eos ``<|im_end|>``. ``True``: Llama-3-style template
        (:data:`LLAMA3_DATE_TEMPLATE`) that starts with ``bos_token``
        (``<|begin_of_text|>``) and writes today's date unless a
        ``date_string`` is passed to ``apply_chat_template``; eos ``<|eot_id|>``.
        Like Llama 3's tokenizer, this variant also prepends BOS when called with
        ``add_special_tokens=True``, so a rendered template tokenized that way
        would start with two BOS tokens (skafa tokenizes with
        ``add_special_tokens=False``).

    Returns
    -------
    tokenizer : transformers.PreTrainedTokenizerFast
        ``is_fast`` is True; ``pad_token`` is ``<|endoftext|>``; ``len(tokenizer)``
        equals :func:`tiny_vocab_size`.

    Examples
    --------
    >>> tok = make_tiny_tokenizer()
    >>> text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
    ...                                tokenize=False, add_generation_prompt=True)
    >>> tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    True
    """
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_tokenizer_json())
    kwargs = dict(pad_token="<|endoftext|>", unk_token=None,
                  additional_special_tokens=list(SPECIAL_TOKENS[1:]))
    if date_in_template:
        bos = "<|begin_of_text|>"
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, backend.token_to_id(bos))],
        )
        kwargs.update(bos_token=bos, eos_token="<|eot_id|>")
        template = LLAMA3_DATE_TEMPLATE
    else:
        kwargs.update(bos_token=None, eos_token="<|im_end|>")
        template = CHATML_TEMPLATE
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tok.chat_template = template
    tok.name_or_path = "skafa-tiny-llama3-date" if date_in_template else "skafa-tiny-chatml"
    return tok


@functools.lru_cache(maxsize=1)
def tiny_vocab_size() -> int:
    """Number of token ids of :func:`make_tiny_tokenizer` (both variants)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json()).get_vocab_size(with_added_tokens=True)


def _finish(model):
    import torch

    model = model.to(torch.float32)
    model.eval()
    model.requires_grad_(False)
    return model


def _build(config, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return _finish(model)


def _common(vocab_size, n_layers, hidden, n_heads, n_kv_heads, intermediate,
            max_position_embeddings):
    if vocab_size is None:
        vocab_size = tiny_vocab_size()
    if hidden % n_heads:
        raise ValueError(f"hidden={hidden} must be divisible by n_heads={n_heads}.")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}.")
    return dict(
        vocab_size=int(vocab_size),
        hidden_size=int(hidden),
        intermediate_size=int(intermediate if intermediate is not None else 2 * hidden),
        num_hidden_layers=int(n_layers),
        num_attention_heads=int(n_heads),
        num_key_value_heads=int(n_kv_heads),
        max_position_embeddings=int(max_position_embeddings),
        pad_token_id=0,
        bos_token_id=SPECIAL_TOKENS.index("<|begin_of_text|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        tie_word_embeddings=True,
    )


def make_tiny_llama(vocab_size=None, n_layers=2, hidden=32, seed=0,
                    max_position_embeddings=512, *, n_heads=4, n_kv_heads=2,
                    intermediate=None):
    """Build a random Llama causal LM (the SmolLM2 architecture), tiny.

    Parameters
    ----------
    vocab_size : int or None, default=None
        ``None`` uses :func:`tiny_vocab_size` (matches :func:`make_tiny_tokenizer`).
    n_layers : int, default=2
        Number of decoder layers.
    hidden : int, default=32
        Hidden size.
    seed : int, default=0
        Seed of the weight initialisation (the global torch RNG state is restored
        afterwards). Same seed, same weights.
    max_position_embeddings : int, default=512
        The model's context length (what :func:`skafa.llm.context_length` reports).
    n_heads, n_kv_heads : int, default=4, 2
        Attention and key/value heads (grouped-query attention, like SmolLM2).
    intermediate : int or None, default=None
        MLP width; ``None`` means ``2 * hidden``.

    Returns
    -------
    model : transformers.LlamaForCausalLM
        float32, eval mode, eager attention, ``requires_grad`` off.
    """
    from transformers import LlamaConfig

    config = LlamaConfig(**_common(vocab_size, n_layers, hidden, n_heads, n_kv_heads,
                                   intermediate, max_position_embeddings))
    return _build(config, seed)


def make_tiny_qwen2(vocab_size=None, n_layers=2, hidden=32, seed=0,
                    max_position_embeddings=512, *, n_heads=4, n_kv_heads=2,
                    intermediate=None):
    """Build a random Qwen2 causal LM (the Qwen2.5 architecture), tiny.

    Same parameters and return conventions as :func:`make_tiny_llama`; Qwen2 adds
    biases to the query/key/value projections.

    Returns
    -------
    model : transformers.Qwen2ForCausalLM
    """
    from transformers import Qwen2Config

    config = Qwen2Config(**_common(vocab_size, n_layers, hidden, n_heads, n_kv_heads,
                                   intermediate, max_position_embeddings))
    return _build(config, seed)


def make_tiny_gemma(vocab_size=None, n_layers=2, hidden=32, seed=0,
                    max_position_embeddings=512, *, n_heads=4, n_kv_heads=2,
                    intermediate=None):
    """Build a random Gemma-2 causal LM, tiny.

    Same parameters and return conventions as :func:`make_tiny_llama`. Gemma-2
    differs in ways that matter for reading activations: embeddings are scaled by
    ``sqrt(hidden)``, each layer has four norms (``input_layernorm``,
    ``post_attention_layernorm`` applied to the attention *output*,
    ``pre_feedforward_layernorm`` feeding the MLP, ``post_feedforward_layernorm``),
    and layers alternate sliding-window and global attention.

    Returns
    -------
    model : transformers.Gemma2ForCausalLM
    """
    from transformers import Gemma2Config

    kw = _common(vocab_size, n_layers, hidden, n_heads, n_kv_heads, intermediate,
                 max_position_embeddings)
    config = Gemma2Config(**kw, head_dim=hidden // n_heads,
                          query_pre_attn_scalar=hidden // n_heads, sliding_window=64)
    return _build(config, seed)


def make_tiny_gemma3(vocab_size=None, n_layers=2, hidden=32, seed=0,
                     max_position_embeddings=512, *, n_heads=4, n_kv_heads=2,
                     intermediate=None, sliding_window=64):
    """Build a random Gemma-3 text causal LM (the Gemma-3-270M architecture), tiny.

    Same parameters and return conventions as :func:`make_tiny_llama`. Like
    Gemma-2 it scales embeddings and has sandwich norms; Gemma-3 adds query/key
    norms and, as in the real model, puts one global-attention layer after
    every five sliding-window layers (here: the last of every six layers, and
    always the last layer, so a two-layer model has one of each).

    Parameters
    ----------
    sliding_window : int, default=64
        Window of the sliding-attention layers.

    Returns
    -------
    model : transformers.Gemma3ForCausalLM
    """
    from transformers import Gemma3TextConfig

    kw = _common(vocab_size, n_layers, hidden, n_heads, n_kv_heads, intermediate,
                 max_position_embeddings)
    layer_types = ["full_attention" if (i + 1) % 6 == 0 or i == n_layers - 1
                   else "sliding_attention" for i in range(n_layers)]
    config = Gemma3TextConfig(**kw, head_dim=hidden // n_heads,
                              query_pre_attn_scalar=hidden // n_heads,
                              sliding_window=int(sliding_window), layer_types=layer_types)
    return _build(config, seed)


def make_conversations(n=6, *, min_turns=2, max_turns=6, seed=0,
                       speakers=("planner", "coder", "critic"), labelled=True):
    """Make synthetic multi-agent conversations with a planted arithmetic error.

    Each conversation asks for the sum of two numbers. Every turn contains a short
    sentence and a computation ``"I computed a + b = c"``; the computation is
    correct in every turn except the decisive one (``mistake_step``), where it is
    off by one to nine. Task ids repeat in pairs (``"task-0"`` for conversations 0
    and 1, ``"task-1"`` for 2 and 3, ...), so grouped splitters matter.

    Parameters
    ----------
    n : int, default=6
        Number of conversations.
    min_turns, max_turns : int, default=2, 6
        Inclusive range of the number of turns.
    seed : int, default=0
        Seed; same seed, same conversations.
    speakers : sequence of str, default=("planner", "coder", "critic")
        Agent names; turn ``t`` is spoken by ``speakers[t % len(speakers)]``.
    labelled : bool, default=True
        Set ``mistake_step`` and ``mistake_agent`` (the decisive turn's speaker).
        With ``False`` both are ``None`` (the error is still planted).

    Returns
    -------
    conversations : list of Conversation
        ``record_id`` is ``"synthetic/{i}"``; ``expected_answer`` is the true sum.

    Examples
    --------
    >>> convs = make_conversations(4, seed=1)
    >>> [c.task_id for c in convs]
    ['task-0', 'task-0', 'task-1', 'task-1']
    """
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}.")
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"Need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}.")
    speakers = tuple(speakers)
    if not speakers:
        raise ValueError("speakers must not be empty.")
    rng = np.random.default_rng(seed)
    n_tasks = (n + 1) // 2
    tasks = []
    for k in range(n_tasks):
        a, b = (int(v) for v in rng.integers(2, 99, size=2))
        tasks.append((a, b, _TASKS[int(rng.integers(len(_TASKS)))].format(a=a, b=b)))
    convs = []
    for i in range(n):
        a, b, task = tasks[i // 2]
        n_turns = int(rng.integers(min_turns, max_turns + 1))
        step = int(rng.integers(n_turns))
        turns = []
        for t in range(n_turns):
            x, y = (int(v) for v in rng.integers(2, 99, size=2))
            if t == 0:
                x, y = a, b
            result = x + y
            if t == step:
                result += int(rng.integers(1, 10))
            sentence = (f"{_SUBJECTS[rng.integers(len(_SUBJECTS))].capitalize()} "
                        f"{_VERBS[rng.integers(len(_VERBS))]} "
                        f"{_OBJECTS[rng.integers(len(_OBJECTS))]}.")
            turns.append(Turn(speakers[t % len(speakers)],
                              f"{sentence} I computed {x} + {y} = {result}."))
        convs.append(Conversation(
            turns,
            task=task,
            expected_answer=str(a + b),
            task_id=f"task-{i // 2}",
            mistake_step=step if labelled else None,
            mistake_agent=turns[step].speaker if labelled else None,
            record_id=f"synthetic/{i}",
        ))
    return convs


def register_tiny_model(name="skafa-tiny-llama"):
    """Register a tiny random Llama and its tokenizer under ``name``, once.

    The model estimators take a model *name* (:func:`skafa.llm.load_model`);
    this gives tests, doctests and :mod:`skafa.utils.estimator_checks` one to use
    without any download. Registering again under the same name is a no-op.

    Parameters
    ----------
    name : str, default="skafa-tiny-llama"

    Returns
    -------
    name : str

    Examples
    --------
    >>> from skafa import TurnActivationTransformer
    >>> extractor = TurnActivationTransformer(register_tiny_model(), sites=["resid_final"])
    >>> extractor.fit_transform(make_conversations(2)).values.shape[1:]
    (1, 32)
    """
    from .llm import register_model, registered_models

    if name not in registered_models():
        register_model(name, make_tiny_llama(), make_tiny_tokenizer())
    return name


def make_site_features(n=90, *, signal_site=3, n_sites=5, n_features=6, signal=3.0, seed=0,
                       task_ids=True):
    """Multi-site TurnFeatures with the decisive-turn signal at one site.

    Sites are named ``"s0"``, ``"s1"``, ...; speakers ``"agent0"``..``"agent3"``;
    three conversations per task id.

    Returns
    -------
    X : TurnFeatures
    y : ndarray of int, shape (n,)
    """
    from .features import TurnFeatures

    rng = np.random.default_rng(seed)
    n_turns = rng.integers(3, 11, size=n)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n) * n_turns).astype(np.int64)
    values = rng.normal(size=(offsets[-1], n_sites, n_features))
    values[offsets[:-1] + y, signal_site, 0] += signal
    X = TurnFeatures(
        values,
        offsets,
        sites=tuple(f"s{j}" for j in range(n_sites)),
        speakers=[f"agent{j % 4}" for j in range(offsets[-1])],
        task_ids=[f"task{i // 3}" for i in range(n)] if task_ids else None,
    )
    return X, y


def write_who_and_when(folder, convs):
    """Write conversations as Who&When-format records (``Algorithm-Generated/1.json``, ...).

    Returns
    -------
    folder : pathlib.Path
    """
    import json
    from pathlib import Path

    folder = Path(folder)
    subset = folder / "Algorithm-Generated"
    subset.mkdir(parents=True)
    for i, c in enumerate(convs):
        record = {
            "question": c.task, "ground_truth": c.expected_answer, "question_ID": c.task_id,
            "history": [{"content": t.content, "role": "assistant", "name": t.speaker}
                        for t in c.turns],
            "mistake_step": str(c.mistake_step), "mistake_agent": c.mistake_agent,
        }
        (subset / f"{i + 1}.json").write_text(json.dumps(record))
    return folder
