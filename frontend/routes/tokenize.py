"""``POST /tokenize`` and ``/detokenize``, as vLLM's: a prompt, or chat messages rendered
with the chat template, to token ids; token ids back to text."""

from __future__ import annotations

from aiohttp import web

from frontend.http.request_body import read_body
from frontend.openai.chat_prompt import chat_prompt, check_generation_prompt
from frontend.openai.serving import ServingContext, json_response
from frontend.schema.errors import bad_request
from frontend.schema.requests import DetokenizeRequest, TokenizeRequest
from frontend.tools.choice import check_tools, template_tools


def tokenize_routes(ctx: ServingContext) -> list[tuple[str, str, object]]:
    tokenizer = ctx.tokenizer

    async def tokenize(request: web.Request) -> web.Response:
        req = await read_body(request, TokenizeRequest)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await tokenizer.encode_async(req.prompt, add_special_tokens=add)
        else:
            check_generation_prompt(req)
            check_tools(req.tools)
            ids, _ = await chat_prompt(ctx, req.messages, req.add_generation_prompt, bool(req.add_special_tokens),
                                       template_tools(req.tools),
                                       chat_template_kwargs=req.chat_template_kwargs, continue_final_message=req.continue_final_message,
                                       chat_template=req.chat_template)
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": ctx.config.max_model_len, "tokens": ids, "token_strs": strs})

    async def detokenize(request: web.Request) -> web.Response:
        req = await read_body(request, DetokenizeRequest)
        ctx.check_model(req.model)
        ctx.check_token_ids(req.tokens, "tokens")
        # NOTE: vLLM's transformers decode, whose default keeps the special tokens
        return json_response({"prompt": await tokenizer.decode_async(req.tokens, skip_special_tokens=False)})

    return [("POST", "/tokenize", tokenize), ("POST", "/detokenize", detokenize)]
