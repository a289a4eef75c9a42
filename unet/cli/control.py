"""The command line's half of control: the flags of a controlled run beside the plain one, and the plan they ask
for, every word checked against the prompts before any work (`UsageError` naming the bad value)."""

from __future__ import annotations

from crossattn.control import MAX_FACTOR, align_prompts, parse_weights, word_positions
from crossattn.errors import UsageError
from crossattn.text import prompt_words

from ..control import ControlPlan
from ..pipeline import ScenePipeline, shape_words


def add_control_args(parser) -> None:
    g = parser.add_argument_group("control", "a second, controlled run with the same seed, written beside the "
                                             "plain one (controlled/, compare.png, meta.json 'control')")
    g.add_argument("--reweight", nargs="+", action="extend", metavar="WORD=FACTOR", default=None,
                   help=f"scale these words' attention, e.g. red=2 (prompt-to-prompt's re-weighting; factors within "
                        f"+-{MAX_FACTOR:g}); repeated flags add up")
    g.add_argument("--reweight-steps", nargs=2, type=float, metavar=("START", "END"), default=None,
                   help="share of the run to re-weight in, START < END (default 0 1: all of it)")
    g.add_argument("--excite", nargs="*", action="extend", metavar="WORD", default=None,
                   help="attend-and-excite these subject words (bare flag: the prompt's object words); repeated "
                        "flags add up")
    g.add_argument("--edit", default=None, metavar="PROMPT",
                   help="prompt-to-prompt: sample this edited prompt with the plain prompt's attention replayed "
                        "(same number of words: word swap; words only added: refinement)")
    g.add_argument("--cross-replace-steps", type=float, default=None, help="with --edit: share of the run whose "
                   "cross-attention is replayed (default 0.8)")
    g.add_argument("--self-replace-steps", type=float, default=None, help="with --edit: share of the run whose "
                   "self-attention is replayed (default 0.4)")
    g.add_argument("--local-blend", action="store_true", help="keep the plain image outside the edited words' maps")


def plan_control(pipe, args) -> ControlPlan | None:
    """The control the command line asks for, or None; raises UsageError naming any bad value."""
    shaping = [("--reweight-steps", args.reweight_steps, args.reweight, "--reweight"),
               ("--cross-replace-steps", args.cross_replace_steps, args.edit, "--edit"),
               ("--self-replace-steps", args.self_replace_steps, args.edit, "--edit"),
               ("--local-blend", args.local_blend or None, args.edit, "--edit")]
    for flag, value, control, control_flag in shaping:
        if value is not None and control is None:
            raise UsageError(f"{flag} needs {control_flag}, which is not given: add {control_flag} or drop {flag}")
    if args.reweight is None and args.excite is None and args.edit is None:
        return None
    if not isinstance(pipe, ScenePipeline):
        raise UsageError("--reweight/--excite/--edit need this project's pipeline (its sampling loop calls the "
                         "controller); for diffusers models use crossattn.control.Controller in Python")
    if args.edit is not None and len(args.prompts) != 1:
        raise UsageError(f"--edit takes exactly one prompt to edit, got {len(args.prompts)}")
    defaults = ControlPlan()
    start, end = args.reweight_steps or defaults.reweight_steps
    cross = defaults.cross_replace_steps if args.cross_replace_steps is None else args.cross_replace_steps
    self_steps = defaults.self_replace_steps if args.self_replace_steps is None else args.self_replace_steps
    for name, value in (("--reweight-steps START", start), ("--reweight-steps END", end),
                        ("--cross-replace-steps", cross), ("--self-replace-steps", self_steps)):
        if not 0.0 <= value <= 1.0:  # also refuses nan
            raise UsageError(f"{name} must be a share of the run between 0 and 1, got {value}")
    if start >= end:
        raise UsageError(f"--reweight-steps {start:g} {end:g} is {'empty' if start == end else 'reversed'}: START "
                         "must be below END (shares of the run, e.g. 0 0.5)")
    excite = None if args.excite is None else list(dict.fromkeys(args.excite))
    plan = ControlPlan(reweight_steps=(start, end), excite=excite, edit=args.edit, cross_replace_steps=cross,
                       self_replace_steps=self_steps, local_blend=args.local_blend, shape_words=shape_words(pipe))
    try:
        if args.reweight is not None:
            plan.reweight = parse_weights(args.reweight)
        for prompt in args.prompts:
            target = prompt_words(pipe.tokenizer, plan.controlled_prompt(prompt))
            texts = [w.text for w in target]
            word_positions(target, list(plan.reweight), "--reweight")
            if plan.excite is not None and not plan.subjects(texts):
                raise ValueError(f"--excite: {plan.controlled_prompt(prompt)!r} has no object word "
                                 f"({', '.join(plan.shape_words)}); name the subjects, e.g. --excite {texts[-1]}")
            word_positions(target, plan.excite or [], "--excite")
            if plan.edit is not None:
                alignment = align_prompts(pipe.tokenizer, prompt, plan.edit)
                if plan.local_blend and not alignment.target_tokens:
                    raise ValueError("--local-blend: the edit changes no word, so there is nothing to blend")
    except ValueError as e:
        raise UsageError(str(e)) from e
    return plan
