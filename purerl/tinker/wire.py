"""The Tinker wire formats the SDK speaks, read into purerl records and written back.

``forward_backward`` requests arrive as protobuf (``tinker.proto.tinker_public_pb2``, the SDK's own
schema, imported), other requests as JSON parsed by the SDK's pydantic request types (which forbid
unknown fields: an unknown parameter is refused, never ignored). ``sample`` and ``forward_backward``
results go back as protobuf, the SDK's only accepted form for them; the other results as JSON, each
one of the SDK's response types (:func:`json_answer`). Everything this server cannot
honour is refused in one line (``ValueError``): image or audio chunks, sparse or 2-d loss inputs,
prompt log-probs and their relatives, stability records. Provenance spans are checked and unused.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import pydantic
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from purerl.tinker.sampler import Sample, SamplingRequest
from purerl.tinker.trainer import Datum

__all__ = ["ForwardBackward", "forward_backward_output", "forward_backward_request", "header_of", "json_answer",
           "prompt_tokens", "sample_response", "sampling_request"]

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@attrs.frozen
class ForwardBackward:
    """A decoded ``forward_backward`` request."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(name: str, msg: Any) -> np.ndarray:
    if msg.WhichOneof("encoding") != "dense":
        raise ValueError(f"loss_fn_inputs {name}: sparse tensors (2-d targets or weights) are not served")
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"loss_fn_inputs {name}: dtype {pb.DType.Name(msg.dtype)} is not served")
    array = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape) or [len(array)]
    if len(shape) != 1 or shape[0] != len(array):
        raise ValueError(f"loss_fn_inputs {name}: shape {shape} is not served (one value per input token)")
    return array


def _tokens(chunks: Any, where: str) -> list[int]:
    out: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(f"{where}: {kind} chunks are not served (text tokens only)")
        out.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    return out


def header_of(body: bytes) -> Any:
    """The ``ForwardBackwardRequest`` message of a (decompressed) protobuf body (``ValueError``
    when it is not one); its ``model_id`` and ``seq_id`` place the call before its data is read."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError
        raise ValueError(f"the forward_backward body is not a ForwardBackwardRequest message ({err})") from None
    return msg


def _check_spans(datum: Any, inputs: int, targets: int, i: int) -> None:
    """Provenance spans (the cookbook attaches them to every sampled datum) tile their fields or are
    refused; they are claims about where tokens came from, which no served loss reads (only the
    refused ``stable_reinforce`` would), so they are otherwise unused."""
    for field, expected in (("model_input_spans", inputs), ("loss_fn_input_spans", targets)):
        spans = getattr(datum, field)
        covered = sum(getattr(s, s.WhichOneof("span") or "prompt_tokens").length for s in spans)
        if len(spans) and covered != expected:
            raise ValueError(f"datum {i}: {field} cover {covered} positions, not the field's {expected}")


def forward_backward_request(msg: Any) -> ForwardBackward:
    """The request of a ``ForwardBackwardRequest`` message (:func:`header_of`)."""
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # the SDK writes both; v2 carries strings too
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = []
    for i, datum in enumerate(msg.data):
        inputs = {name: _tensor(name, tensor) for name, tensor in datum.loss_fn_inputs.items()}
        tokens = _tokens(datum.model_input, f"datum {i}")
        _check_spans(datum, len(tokens), len(inputs.get("target_tokens", ())), i)
        data.append(Datum(tokens, inputs))
    keys = {frozenset(d.inputs) for d in data}
    if len(keys) > 1:
        raise ValueError("forward_backward: every datum of a request must carry the same loss_fn_inputs")
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _batched(arrays: Sequence[np.ndarray], dtype: int) -> Any:
    data = b"".join(a.tobytes() for a in arrays)
    offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=dtype)


def forward_backward_output(logprobs: Sequence[np.ndarray], loss_sum: float,
                            metrics: Mapping[str, float] | None = None) -> bytes:
    """A ``ForwardBackwardOutput``: each datum's ``logprobs`` (float32 ``[N]``) and the metrics
    (``loss:sum`` first)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs),
                            fields={"logprobs": _batched([np.asarray(x, np.float32) for x in logprobs],
                                                         pb.DTYPE_FLOAT32)})
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                   metrics={"loss:sum": float(loss_sum), **(metrics or {})})
    return out.SerializeToString()


def json_answer(response: pydantic.BaseModel) -> dict[str, Any]:
    """The JSON of a result built as the SDK's response type ``response``: the fields this server set, so an
    optional field it does not state (e.g. ``GetInfoResponse.optimizer_config``) keeps the client's default."""
    return response.model_dump(mode="json", exclude_unset=True)


def sample_response(samples: Sequence[Sample]) -> bytes:
    """A ``SampleResponse`` of the samples (tokens int32, log-probs float32)."""
    sequences = [pb.SampledSequence(stop_reason=pb.STOP_REASON_LENGTH if s.length else pb.STOP_REASON_STOP,
                                    tokens=np.asarray(s.ids, np.int32).tobytes(),
                                    logprobs=np.asarray(s.logprobs, np.float32).tobytes()) for s in samples]
    return pb.SampleResponse(sequences=sequences).SerializeToString()


def prompt_tokens(model_input: Any, where: str) -> list[int]:
    """The tokens of a JSON ``ModelInput``'s chunks, joined (text chunks only)."""
    out: list[int] = []
    for chunk in model_input.chunks:
        if getattr(chunk, "type", None) != "encoded_text":
            raise ValueError(f"{where}: {getattr(chunk, 'type', 'unknown')} chunks are not served (text tokens only)")
        out.extend(int(t) for t in chunk.tokens)
    return out


_PROMPT_EXTRAS = ("prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs",
                  "prompt_alt_tokens_k", "prompt_logprobs_last_n", "record_stability_info")


def sampling_request(body: Mapping[str, Any]) -> tuple[types.SampleRequest, SamplingRequest]:
    """The SDK's ``SampleRequest`` of a JSON body and its checked sampling settings."""
    unknown = sorted(set(body.get("sampling_params") or {}) - set(types.SamplingParams.model_fields))
    if unknown:
        raise ValueError(f"sampling_params.{unknown[0]} is not a sampling parameter this server knows")
    request = types.SampleRequest.model_validate(dict(body))
    for name in _PROMPT_EXTRAS:
        if getattr(request, name):
            raise ValueError(f"{name} is not served (sampled tokens' own log-probs only)")
    params = request.sampling_params
    stop = params.stop
    strings: tuple[str, ...] = ()
    ids: tuple[int, ...] | None = None
    if isinstance(stop, str):  # stop strings keep EOS as an end as well; a list of ids (even []) replaces it
        strings = (stop,)
    elif stop is not None:
        items = list(stop)
        if all(isinstance(x, str) for x in items):
            strings, ids = tuple(items), (None if items else ())
        elif all(isinstance(x, int) for x in items):
            ids = tuple(items)
        else:
            raise ValueError("sampling_params.stop: strings or token ids, not both")
    return request, SamplingRequest(params.max_tokens, float(params.temperature), float(params.top_p),
                                    int(params.top_k), params.seed, strings, ids)
