# ruff: noqa: E501  (captured lines are kept whole)
"""Shapes captured from vLLM 0.33 and SGLang 0.5.23 (``reference/vllm-0.33-captures/``).

Facts for key-for-key comparisons; IDs, texts and numbers in them are synthetic.
"""

CHUNKS: dict[str, str] = {
    "chunks: chat first chunk (return_token_ids unset)": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}'
    ),
    "chunks: chat first chunk (return_token_ids=true)": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[151644,872,198,9707],"prompt_text":null}'
    ),
    "chunks: chat reasoning delta": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"reasoning":"Let me think"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}'
    ),
    "chunks: chat content delta (return_token_ids=true)": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":[9707]}],"kv_transfer_params":null}'
    ),
    "chunks: chat content delta with logprobs (logprobs=true, top_logprobs=2)": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":{"content":[{"token":"Hello","logprob":-0.01,"bytes":[72,101,108,108,111],"top_logprobs":[{"token":"Hello","logprob":-0.01,"bytes":[72,101,108,108,111]},{"token":"Hi","logprob":-4.6,"bytes":[72,105]}]}]},"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}'
    ),
    "chunks: chat tool-call header delta (hermes parser)": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":null,"tool_calls":[{"id":"chatcmpl-tool-9f1c2","type":"function","index":0,"function":{"name":"get_weather"}},{"index":0,"function":{"arguments":"{\\"city\\": \\""}}]},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}'
    ),
    "chunks: chat tool-call args delta": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"Paris\\"}"}}]},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}'
    ),
    "chunks: chat final chunk (finish_reason, include_usage off)": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null,"token_ids":null,"weight_versions":null}],"system_fingerprint":"fp_3e8a1c2d","kv_transfer_params":null}'
    ),
    "chunks: chat final chunk with stop string (stop=['</answer>'])": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"."},"logprobs":null,"finish_reason":"stop","stop_reason":"</answer>","token_ids":null,"weight_versions":null}],"kv_transfer_params":null}'
    ),
    "chunks: chat final chunk (include_usage on: no fingerprint here)": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}'
    ),
    "chunks: chat content delta with continuous_usage_stats": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,"completion_tokens_details":null},"kv_transfer_params":null}'
    ),
    "chunks: chat usage-only final chunk": (
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1767225600,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":12,"total_tokens":17,"completion_tokens":5},"system_fingerprint":"fp_3e8a1c2d"}'
    ),
    "chunks: chat non-streaming (JSONResponse(content=model_dump()))": (
        '{"id": "chatcmpl-abc123", "object": "chat.completion", "created": 1767225600, "model": "qwen3-8b", "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "refusal": null, "annotations": null, "audio": null, "function_call": null, "tool_calls": [{"id": "chatcmpl-tool-9f1c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}], "reasoning": "Let me think"}, "logprobs": null, "finish_reason": "tool_calls", "stop_reason": null, "token_ids": [9707, 11, 1879], "routed_experts": null, "weight_versions": null}], "service_tier": null, "system_fingerprint": "fp_3e8a1c2d", "usage": {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3, "prompt_tokens_details": null, "completion_tokens_details": null}, "prompt_logprobs": null, "prompt_token_ids": [151644, 872, 198, 9707], "prompt_text": null, "kv_transfer_params": null, "ec_transfer_params": null, "metrics": null}'
    ),
    "chunks: completion delta (defaults)": (
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" Paris","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}'
    ),
    "chunks: completion first delta (return_token_ids=true)": (
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" Paris","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[791,6864,315,9822,374],"token_ids":[12366],"weight_versions":null}],"kv_transfer_params":null}'
    ),
    "chunks: completion delta with logprobs=2": (
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" Paris","logprobs":{"text_offset":[27],"token_logprobs":[-0.05],"tokens":[" Paris"],"top_logprobs":[{" Paris":-0.05," Lyon":-3.2}]},"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}'
    ),
    "chunks: completion final delta (stop string, include_usage off)": (
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":".","logprobs":null,"finish_reason":"stop","stop_reason":"\\n","prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"system_fingerprint":"fp_3e8a1c2d","kv_transfer_params":null}'
    ),
    "chunks: completion usage-only chunk": (
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3},"system_fingerprint":"fp_3e8a1c2d"}'
    ),
    "chunks: completion non-streaming": (
        '{"id": "cmpl-abc123", "object": "text_completion", "created": 1767225600, "model": "qwen3-8b", "choices": [{"index": 0, "text": " Paris.", "logprobs": null, "finish_reason": "stop", "stop_reason": null, "token_ids": [12366, 13], "prompt_logprobs": null, "prompt_token_ids": [791, 6864, 315, 9822, 374], "routed_experts": null, "weight_versions": null}], "service_tier": null, "system_fingerprint": "fp_3e8a1c2d", "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": null, "completion_tokens_details": null}, "kv_transfer_params": null, "ec_transfer_params": null, "metrics": null}'
    ),
    "chunks: error: validation (VLLMValidationError) -> HTTP 400": (
        '{"error": {"message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "type": "BadRequestError", "param": "stream_options", "code": 400}}'
    ),
    "chunks: error: not found -> HTTP 404": (
        '{"error": {"message": "The model `foo` does not exist.", "type": "NotFoundError", "param": null, "code": 404}}'
    ),
    "chunks: error: queue overflow -> HTTP 503": (
        '{"error": {"message": "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.", "type": "Service Unavailable", "param": null, "code": 503}}'
    ),
    "chunks: error: generation error -> HTTP 500": (
        '{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}'
    ),
    "chunks: error: retryable -> HTTP 503": (
        '{"error": {"message": "Request failed; please retry", "type": "ServiceUnavailableError", "param": null, "code": 503}}'
    ),
    "chunks: error: ValueError fallback -> HTTP 400": (
        '{"error": {"message": "bad value", "type": "BadRequestError", "param": null, "code": 400}}'
    ),
    "chunks: error: NotImplementedError -> HTTP 501": (
        '{"error": {"message": "The model does not support Chat Completions API", "type": "NotImplementedError", "param": null, "code": 501}}'
    ),
    "chunks: error: RuntimeError -> HTTP 500": (
        '{"error": {"message": "boom", "type": "InternalServerError", "param": null, "code": 500}}'
    ),
    "chunks: error: _check_model -> HTTP 404": (
        '{"error": {"message": "The model `foo` does not exist. Valid aliases: qwen3-8b.", "type": "NotFoundError", "param": "model", "code": 404}}'
    ),
    "sglang: sglang chat first chunk": (
        'data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"","reasoning_content":null},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}'
    ),
    "sglang: sglang chat reasoning delta": (
        'data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":"think"},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}'
    ),
    "sglang: sglang chat tool-call header delta": (
        'data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":null,"tool_calls":[{"id":"call_0","index":0,"type":"function","function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}'
    ),
    "sglang: sglang chat tool-call args delta": (
        'data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":null,"tool_calls":[{"id":null,"index":0,"type":"function","function":{"name":null,"arguments":"{\\"city\\": \\"Paris\\"}"}}]},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}'
    ),
    "sglang: sglang chat final chunk (EOS token id as matched_stop)": (
        'data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":null},"logprobs":null,"finish_reason":"stop","matched_stop":151645}],"usage":null}'
    ),
    "sglang: sglang chat usage chunk": (
        'data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3,"prompt_tokens_details":null,"reasoning_tokens":0,"completion_tokens_details":null}}'
    ),
    "sglang: sglang chat sglext ids chunk (return_input_ids_in_sglext/return_output_ids_in_sglext)": (
        'data: {"id":"abc","object":"chat.completion.chunk","created":1767225600,"model":"m","choices":[],"usage":null,"sglext":{"input_ids":[1,2,3],"output_ids":[[9707,1879,0]]}}'
    ),
    "sglang: sglang completion first delta (return_token_ids)": (
        'data: {"id":"abc","object":"text_completion","created":1767225600,"model":"m","choices":[{"index":0,"text":" Paris","logprobs":null,"finish_reason":null,"matched_stop":null,"token_ids":[12366],"prompt_token_ids":[1,2,3]}],"usage":null}'
    ),
    "sglang: sglang chat non-stream (return_token_ids)": (
        '{"id":"abc","object":"chat.completion","created":1767225600,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello world!","reasoning_content":null},"logprobs":null,"finish_reason":"stop","matched_stop":151645,"prompt_token_ids":[1,2,3],"response_token_ids":[9707,1879,0]}],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3,"prompt_tokens_details":null,"reasoning_tokens":0,"completion_tokens_details":null},"metadata":null}'
    ),
    "sglang: sglang non-stream error body": (
        '{"object": "error", "message": "bad", "type": "BadRequestError", "param": null, "code": 400}'
    ),
    "sglang: sglang streaming error frame": (
        'data: {"error": {"object": "error", "message": "bad", "type": "BadRequestError", "param": null, "code": 400}}'
    ),
    "errors: chat stream_options without stream: HTTP 400": (
        '{"error":{"message":"Stream options can only be defined when `stream=True`. (parameter=stream_options)","type":"BadRequestError","param":"stream_options","code":400}}'
    ),
    "errors: chat missing messages: HTTP 400": (
        "{\"error\":{\"message\":\"1 validation error:\\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 1 items>'}\",\"type\":\"Bad Request\",\"param\":\"body.messages\",\"code\":400}}"
    ),
    "errors: chat n wrong type: HTTP 400": (
        "{\"error\":{\"message\":\"1 validation error:\\n  {'type': 'int_parsing', 'loc': 'body.n', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'two'}\",\"type\":\"Bad Request\",\"param\":\"body.n\",\"code\":400}}"
    ),
    "errors: chat top_logprobs without logprobs: HTTP 400": (
        '{"error":{"message":"when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)","type":"BadRequestError","param":"top_logprobs","code":400}}'
    ),
    "errors: chat prompt_logprobs with stream: HTTP 400": (
        '{"error":{"message":"`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)","type":"BadRequestError","param":"prompt_logprobs","code":400}}'
    ),
    "errors: chat tools empty: HTTP 400": (
        '{"error":{"message":"`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. (parameter=tools)","type":"BadRequestError","param":"tools","code":400}}'
    ),
    "errors: chat tool_choice without tools: HTTP 400": (
        '{"error":{"message":"When using `tool_choice`, `tools` must be set. (parameter=tool_choice)","type":"BadRequestError","param":"tool_choice","code":400}}'
    ),
    "errors: chat named tool mismatch: HTTP 400": (
        '{"error":{"message":"The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)","type":"BadRequestError","param":"tool_choice","code":400}}'
    ),
    "errors: chat response_format json_schema missing schema: HTTP 400": (
        '{"error":{"message":"When response_format type is \'json_schema\', the \'json_schema\' field must be provided. (parameter=response_format)","type":"BadRequestError","param":"response_format","code":400}}'
    ),
    "errors: chat response_format bad type: HTTP 400": (
        "{\"error\":{\"message\":\"6 validation errors:\\n  {'type': 'literal_error', 'loc': 'body.response_format.type', 'msg': \\\"Input should be 'text', 'json_object' or 'json_schema'\\\", 'input': 'xml', 'ctx': {'expected': \\\"'text', 'json_object' or 'json_schema'\\\"}}\\n  {'type': 'literal_error', 'loc': 'body.response_format.type', 'msg': \\\"Input should be 'structural_tag'\\\", 'input': 'xml', 'ctx': {'expected': \\\"'structural_tag'\\\"}}\\n  {'type': 'missing', 'loc': 'body.response_format.format', 'msg': 'Field required', 'input': '<dict of 1 items>'}\\n  {'type': 'literal_error', 'loc': 'body.response_format.type', 'msg': \\\"Input should be 'structural_tag'\\\", 'input': 'xml', 'ctx': {'expected': \\\"'structural_tag'\\\"}}\\n  {'type': 'missing', 'loc': 'body.response_format.structures', 'msg': 'Field required', 'input': '<dict of 1 items>'}\\n  {'type': 'missing', 'loc': 'body.response_format.triggers', 'msg': 'Field required', 'input': '<dict of 1 items>'}\",\"type\":\"Bad Request\",\"param\":\"body.response_format.type\",\"code\":400}}"
    ),
    "errors: chat stream_interval 0: HTTP 400": (
        "{\"error\":{\"message\":\"1 validation error:\\n  {'type': 'greater_than_equal', 'loc': 'body.stream_interval', 'msg': 'Input should be greater than or equal to 1', 'input': '0', 'ctx': {'ge': 1}}\",\"type\":\"Bad Request\",\"param\":\"body.stream_interval\",\"code\":400}}"
    ),
    "errors: chat unknown/unsupported fields accepted: HTTP 200": (
        '{"ok":true,"n":1,"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false},"tool_choice":"none","extras":["audio","best_of","modalities","store"]}'
    ),
    "errors: cmpl best_of (removed field) accepted: HTTP 200": ('{"ok":true,"extras":["best_of"]}'),
    "errors: cmpl logprobs negative: HTTP 400": (
        '{"error":{"message":"`logprobs` must be a positive value or -1. (parameter=logprobs, value=-5)","type":"BadRequestError","param":"logprobs","code":400}}'
    ),
    "errors: cmpl empty prompt: HTTP 400": (
        '{"error":{"message":"Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)","type":"BadRequestError","param":"prompt","code":400}}'
    ),
    "errors: wrong content-type: HTTP 400": (
        '{"error":{"message":"1 validation error:\\n  Unsupported Media Type: Only \'application/json\' is allowed","type":"Bad Request","param":null,"code":400}}'
    ),
    "errors: malformed JSON: HTTP 400": (
        "{\"error\":{\"message\":\"1 validation error:\\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double quotes'}}\",\"type\":\"Bad Request\",\"param\":\"body.1\",\"code\":400}}"
    ),
    "errors: unknown route: HTTP 404": ('{"detail":"Not Found"}'),
    "errors: wrong method: HTTP 405": ('{"detail":"Method Not Allowed"}'),
}

STREAMS: dict[str, list[str]] = {
    "streams: CHAT: plain stream, no stream_options": [
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-3e8a1c2d","kv_transfer_params":null}',
        "data: [DONE]",
    ],
    "streams: CHAT: include_usage": [
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3},"system_fingerprint":"vllm-0.33.0-3e8a1c2d"}',
        "data: [DONE]",
    ],
    "streams: CHAT: include_usage + continuous_usage_stats": [
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":4,"total_tokens":4,"completion_tokens":0,"completion_tokens_details":null},"prompt_token_ids":null,"prompt_text":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1,"completion_tokens_details":null},"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"usage":{"prompt_tokens":4,"total_tokens":6,"completion_tokens":2,"completion_tokens_details":null},"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3,"completion_tokens_details":null},"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3},"system_fingerprint":"vllm-0.33.0-3e8a1c2d"}',
        "data: [DONE]",
    ],
    "streams: CHAT: return_token_ids + logprobs/top_logprobs=1": [
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[151644,872,198,9707],"prompt_text":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":{"content":[{"token":"Hello","logprob":-0.01,"bytes":[72,101,108,108,111],"top_logprobs":[{"token":"Hello","logprob":-0.01,"bytes":[72,101,108,108,111]}]}]},"finish_reason":null,"token_ids":[9707]}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":{"content":[{"token":" world","logprob":-0.3,"bytes":[32,119,111,114,108,100],"top_logprobs":[{"token":" world","logprob":-0.3,"bytes":[32,119,111,114,108,100]}]}]},"finish_reason":null,"token_ids":[1879]}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":{"content":[{"token":"!","logprob":-0.5,"bytes":[33],"top_logprobs":[{"token":"!","logprob":-0.5,"bytes":[33]}]}]},"finish_reason":"stop","stop_reason":null,"token_ids":[0],"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-3e8a1c2d","kv_transfer_params":null}',
        "data: [DONE]",
    ],
    "streams: CHAT: n=2": [
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":1,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":1,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":1,"delta":{"content":" world"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[{"index":1,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}',
        'data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1796017983,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":4,"total_tokens":10,"completion_tokens":6},"system_fingerprint":"vllm-0.33.0-3e8a1c2d"}',
        "data: [DONE]",
    ],
    "streams: COMPLETIONS: plain stream": [
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" Paris","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}',
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":",","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}',
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" obviously","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-3e8a1c2d","kv_transfer_params":null}',
        "data: [DONE]",
    ],
    "streams: COMPLETIONS: return_token_ids + logprobs=1 + include_usage": [
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" Paris","logprobs":{"text_offset":[0],"token_logprobs":[-0.05],"tokens":[" Paris"],"top_logprobs":[{" Paris":-0.05,"X":-5.0}]},"finish_reason":null,"stop_reason":null,"prompt_token_ids":[151644,872,198,9707],"token_ids":[12366],"weight_versions":null}],"kv_transfer_params":null}',
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":",","logprobs":{"text_offset":[6],"token_logprobs":[-0.7],"tokens":[","],"top_logprobs":[{",":-0.7,"X":-5.0}]},"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[11],"weight_versions":null}],"kv_transfer_params":null}',
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[{"index":0,"text":" obviously","logprobs":{"text_offset":[7],"token_logprobs":[-1.1],"tokens":[" obviously"],"top_logprobs":[{" obviously":-1.1,"X":-5.0}]},"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":[13],"weight_versions":null}],"kv_transfer_params":null}',
        'data: {"id":"cmpl-abc123","object":"text_completion","created":1767225600,"model":"qwen3-8b","choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3},"system_fingerprint":"vllm-0.33.0-3e8a1c2d"}',
        "data: [DONE]",
    ],
}
