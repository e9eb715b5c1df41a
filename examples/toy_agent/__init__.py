"""A small tool-use task and the agent loop that solves it through an OpenAI-compatible server.

Three tools: `square(x)` and `double(x)` on integers, and `capital(country)` over a fixed table. A question
needs one call (square, double or a capital) or two, the second on the first's result ("What is twice the
square of 7?": square 7, double 49); the answer after the last result is that result. Every call has one
argument, which the model copies from the question or from the latest tool result. The task serves three uses,
one module each:

- `task`: the task and its data. `split` makes training and held-out questions, `turns` the completions a
  question takes, and `sft_rows` writes block-diffusion SFT transcripts of them in `clover serve`'s plain chat
  format (for a model with no chat template, such as the shipped clover-tiny).
- `recipe`: the fine-tuning recipe on those rows (`Recipe`, `finetune`, resumable) and `score_turns`, a
  server-less check of the held-out turns while training (`scripts/train_tool_model.py`).
- `agent`: `run_agent` drives a model through `/v1/chat/completions` with the `openai` client (execute each
  call, feed the result back, stop at a plain answer) and scores the `Episode` it ends with (the tests,
  `benchmarks/agent.py`, `notebooks/05_agent_loop.ipynb`).

Every public name of the three modules is importable from here (`toy_agent.split`, `toy_agent.run_agent`, ...).
The shipped `checkpoints/clover-tiny-tools` was trained on this task with `Recipe`'s settings, then fine-tuned into the
causal-prefix reading (its card has the commands).
"""

from examples.toy_agent.agent import Episode, run_agent
from examples.toy_agent.recipe import Recipe, finetune, lift_digit_embeddings, score_turns, sft_dataset
from examples.toy_agent.task import (
    CAPITALS,
    OPERANDS,
    PHRASES,
    TOOLS,
    Call,
    Task,
    Turn,
    execute,
    make_task,
    sft_rows,
    specs,
    split,
    turns,
)

__all__ = ["CAPITALS", "OPERANDS", "PHRASES", "TOOLS", "Call", "Episode", "Recipe", "Task", "Turn", "execute",
           "finetune", "lift_digit_embeddings", "make_task", "run_agent", "score_turns", "sft_dataset", "sft_rows",
           "specs", "split", "turns"]
