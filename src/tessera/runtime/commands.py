"""The worker protocol: every command the driver sends a worker, and every reply, as a typed message.

A command is a frozen dataclass that names one thing for a worker to do and carries all it needs; the worker
runs it with the handler registered for its type (:data:`tessera.runtime.worker.HANDLERS`) and answers with
one reply dataclass, or with :class:`Failure` when the command raised or is not one the worker knows. The
driver's side sends them from :mod:`tessera.runtime.pool` (starting and stopping workers),
:mod:`tessera.runtime.distributed` (loading programs, moving state, steps and streamed jobs) and
:mod:`tessera.runtime.probe` (the measurements the simulator takes as inputs); :mod:`tessera.runtime.wire`
turns them into bytes for the pipes of local workers and the key-value store of torchrun ranks.

| command | what the worker does | reply |
|---|---|---|
| :class:`Ping` | says who it is | :class:`Pong` |
| :class:`Connect` | joins a gloo process group | :class:`Connected` |
| :class:`Load` | loads phases' graphs, programs, weights; zeroes its state | :class:`Loaded` |
| :class:`SetState` | writes its state instances | :class:`Done` |
| :class:`GetState` | reads them | :class:`StateValues` |
| :class:`Move` | sends and receives rows of state buffers | :class:`Moved` |
| :class:`Step`, :class:`Job` | runs a step (all micro-batches), one micro-batch | :class:`StepResult` |
| :class:`ProbeLink` | ping-pong with a peer | :class:`RoundTrips` |
| :class:`ProbeMessages` | a burst of messages with a peer | :class:`MessageTimes` |
| :class:`Echo` | returns outputs of a size as a step does | :class:`Echoed` |
| :class:`TimeProgram` | times a program's kernels inside steps | :class:`KernelSeconds` |
| :class:`Stop` | answers and exits | :class:`Done` |

Any command can instead get :class:`Failure`: the error it raised, with the worker's traceback.

**Steps in flight.** :class:`Step` and :class:`Move` carry the driver's id (``step``) and their replies
(:class:`StepResult`, :class:`Moved`, :class:`Failure`) carry it back, so the driver matches replies to steps by
id, not by their order; the tags of a step's messages between workers are :func:`step_tag` of that id, so two
steps in flight never take each other's messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.program.program import Program, Transfer

Tensors = dict[str, torch.Tensor]

TAG_SPAN = 2**20  # message tags of one step (a program's transfers, a move's pieces) lie below this
TAG_STEPS = 2**11  # step ids wrap around after this many (gloo takes tags below 2**31)
NO_STEP = -1  # a command sent outside the driver's steps in flight (streamed jobs, probes)
ARENA_TURNS = 8  # a local worker's step outputs take turns through this many sets of shared-memory regions


def step_tag(step: int, tag: int) -> int:
    """The gloo tag of message ``tag`` of step ``step``: distinct for the steps in flight (fewer than
    TAG_STEPS), so a step never receives another step's message."""
    if not 0 <= tag < TAG_SPAN:
        raise ProtocolError(f"message tag {tag} of step {step} is outside 0..{TAG_SPAN - 1}: a step of more than "
                            f"{TAG_SPAN} messages")
    return (max(step, 0) % TAG_STEPS) * TAG_SPAN + tag


class ProtocolError(TesseraError):
    """A message one side cannot read (garbled bytes, a type the other side's code does not have)."""


class UnknownCommand(ProtocolError):
    """A message a worker has no handler for."""


class Command:
    """The base of every command a worker runs."""

    __slots__ = ()


class Reply:
    """The base of every reply a worker sends back."""

    __slots__ = ()


# ------------------------------------------------------------------------------------------------------------
# parts of messages


class SharedTensor(NamedTuple):
    """A step output a local worker left in its shared-memory arena (the driver copies it out)."""

    arena: str
    offset: int
    dtype: str
    shape: list[int]


@dataclass(frozen=True)
class PhaseLoad:
    """What a worker runs of one phase: its graph, this worker's program and the step's transfers."""

    graph: KernelGraph
    program: Program
    transfers: list[Transfer]


@dataclass(frozen=True)
class StateMove:
    """One side of an explicit state move: byte ``spans`` of state ``buffer`` of instance ``microbatch`` sent
    to (``send``) or received from rank ``peer``, under message ``tag``."""

    buffer: str
    microbatch: int
    spans: list[tuple[int, int]]
    peer: int
    tag: int
    send: bool


# ------------------------------------------------------------------------------------------------------------
# commands


@dataclass(frozen=True)
class Ping(Command):
    """Say who you are (the pool's start-up check)."""


@dataclass(frozen=True)
class Connect(Command):
    """Join the process group of ``members`` (worker ids; rank = position) formed for ``epoch``."""

    epoch: int
    members: list[int]


@dataclass(frozen=True)
class Load(Command):
    """Load every phase's graph and program, the weights its kernels read (from ``weights_path``, or the
    tensors of ``weights``) and ``state_instances`` zeroed instances of its state; ``batch_invariant``: GEMMs
    row by row (see `tessera.runtime.executor.Executor`)."""

    phases: dict[str, PhaseLoad]
    weights_path: str | list[str] | None
    weights: Tensors | None
    state_instances: int
    batch_invariant: bool = False


@dataclass(frozen=True)
class SetState(Command):
    """Give state instance i the tensors ``values[i]`` this worker holds."""

    values: list[Tensors]


@dataclass(frozen=True)
class GetState(Command):
    """Send back every state instance (only the buffers ``names``, if given)."""

    names: list[str] | None = None


@dataclass(frozen=True)
class Move(Command):
    """Send and receive the byte ranges of state buffers of ``moves`` (their tags already :func:`step_tag`s of
    the move's id ``step``). Receives are waited for; sends are posted and go on while the worker takes its
    next commands (the receiver may still be busy with a step of its own)."""

    moves: list[StateMove]
    step: int = NO_STEP


@dataclass(frozen=True)
class Step(Command):
    """Run ``phase``'s program: micro-batch m on ``inputs[m]`` and state instance ``state_instances[m]``
    (``trace``: with a timeline of every instruction); ``step``: the driver's id, which tags its messages
    (:func:`step_tag`) and comes back with the reply."""

    phase: str
    inputs: list[Tensors]
    state_instances: list[int]
    trace: bool = False
    step: int = NO_STEP


@dataclass(frozen=True)
class Job(Command):
    """Run only micro-batch ``microbatch`` of ``phase``'s program on ``inputs`` and state instance
    ``state_instance``; ``key`` comes back with the reply (streamed steps)."""

    phase: str
    microbatch: int
    inputs: Tensors
    state_instance: int
    key: tuple[int, int] | None = None
    trace: bool = False


@dataclass(frozen=True)
class ProbeLink(Command):
    """Ping-pong messages of each of ``sizes`` bytes ``repeats`` times with rank ``peer`` (``lead``: send
    first and time the round trips)."""

    peer: int
    sizes: list[int]
    repeats: int
    lead: bool


@dataclass(frozen=True)
class ProbeMessages(Command):
    """Exchange a burst of ``count`` messages of ``nbytes`` each with rank ``peer``, timing this side."""

    peer: int
    count: int
    nbytes: int


@dataclass(frozen=True)
class Echo(Command):
    """Reply with ``micro_batches`` outputs of ``nbytes`` each, returned as step outputs are."""

    nbytes: int = 0
    micro_batches: int = 0


@dataclass(frozen=True)
class TimeProgram(Command):
    """Time every kernel of one device ``program`` of ``graph`` inside steps (its weights read from
    ``weights_path`` for the call): ``warmup`` untimed passes, then ``passes`` timed ones lasting at least
    ``min_seconds``, sleeping ``pause_s`` at each receive."""

    graph: KernelGraph
    program: Program
    weights_path: str | list[str]
    inputs: list[Tensors]
    passes: int
    warmup: int
    min_seconds: float = 0.0
    pause_s: float = 0.0


@dataclass(frozen=True)
class Stop(Command):
    """Answer, then leave the worker loop."""


# ------------------------------------------------------------------------------------------------------------
# replies


@dataclass(frozen=True)
class Done(Reply):
    """A command that has nothing to report ran."""


@dataclass(frozen=True)
class Failure(Reply):
    """The command raised (or is unknown): the error and the worker's traceback."""

    error: str
    traceback: str = ""
    step: int = NO_STEP  # the id of the step or move that failed (NO_STEP: another command)


@dataclass(frozen=True)
class Pong(Reply):
    """The worker's process id, torch threads and device."""

    pid: int
    threads: int
    device: str


@dataclass(frozen=True)
class Connected(Reply):
    """The worker's rank in the new process group (-1: not a member)."""

    rank: int


@dataclass(frozen=True)
class Loaded(Reply):
    """How many weights (and their bytes) and state buffers the worker holds now."""

    weights: int
    weight_bytes: int
    state: int


@dataclass(frozen=True)
class StateValues(Reply):
    """Copies of the worker's state, per instance."""

    state: list[Tensors]


@dataclass(frozen=True)
class Moved(Reply):
    """Bytes this worker sent or received for move ``step``."""

    nbytes: int
    step: int = NO_STEP


@dataclass(frozen=True)
class StepResult(Reply):
    """What a step or job produced on this worker: per micro-batch its outputs held here (tensors, or
    :class:`SharedTensor` for a local driver until the pool copies them out), wall and kernel seconds, the
    timeline of a traced step relative to ``t0`` (the worker's ``time.perf_counter`` at the start), the
    job's ``key`` and the step's id ``step``."""

    outputs: list[dict[str, Any]]
    seconds: float
    compute_s: float
    timeline: list[tuple]
    t0: float
    key: tuple[int, int] | None = None
    step: int = NO_STEP


@dataclass(frozen=True)
class RoundTrips(Reply):
    """The lead's median round trip per message size (zeros from the other side)."""

    round_trip_s: list[float]


@dataclass(frozen=True)
class MessageTimes(Reply):
    """CPU seconds per message of posting a receive, sending, and taking an arrived message."""

    post_s: float
    send_s: float
    recv_s: float


@dataclass(frozen=True)
class Echoed(Reply):
    """The outputs an :class:`Echo` asked for (as :attr:`StepResult.outputs`)."""

    outputs: list[dict[str, Any]]


@dataclass(frozen=True)
class KernelSeconds(Reply):
    """Seconds of each (kernel, micro-batch) in every timed pass."""

    seconds: dict[tuple[int, int], list[float]]


COMMANDS: tuple[type[Command], ...] = (Ping, Connect, Load, SetState, GetState, Move, Step, Job, ProbeLink,
                                       ProbeMessages, Echo, TimeProgram, Stop)
REPLIES: tuple[type[Reply], ...] = (Done, Failure, Pong, Connected, Loaded, StateValues, Moved, StepResult,
                                    RoundTrips, MessageTimes, Echoed, KernelSeconds)
