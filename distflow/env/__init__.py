"""Multi-turn agentic RL: environments, tools, a sandboxed Python tool, token-in/token-out
episode assembly and the episode runner (see docs/agents.md).

Why a package of its own: these are pure building blocks (lists of ints, asyncio, user
environments) with no dependency on the engine or the trainer; the rollout half drives them
through :class:`EpisodeRunner` with any ``generate(prompt_ids, params) -> Completion``.
"""

from distflow.env.api import (EnvError, Environment, EnvTimeout, StepResult, call_env, check_messages,
                              check_step_result, load_environment)
from distflow.env.batching import BatchedGenerate
from distflow.env.episode import (STOP_REASONS, TRAINED_STOPS, Episode, Sample, TemplateError, TokenAssembly,
                                  end_of_turn_id, render_prompt)
from distflow.env.runner import EpisodeRunner, environment_factory, summarize
from distflow.env.sandbox import SandboxResult, make_python_tool, python, run_python
from distflow.env.tools import Tool, ToolCall, ToolEnvironment, function_schema, parse_tool_calls, run_tool_calls

__all__ = [
    "StepResult", "Environment", "EnvError", "EnvTimeout", "load_environment", "call_env", "check_messages",
    "check_step_result", "Episode", "Sample", "TokenAssembly", "render_prompt", "end_of_turn_id", "TemplateError",
    "STOP_REASONS", "TRAINED_STOPS", "EpisodeRunner", "BatchedGenerate", "environment_factory", "summarize",
    "SandboxResult", "run_python", "python", "make_python_tool", "Tool", "ToolCall", "ToolEnvironment",
    "function_schema", "parse_tool_calls", "run_tool_calls",
]
