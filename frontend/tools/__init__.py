"""Tool calls: the request's tools and tool_choice checked, the constraint that forces a
call (a structural tag or a JSON schema), and the calls parsed back from the model's text
(`parsers/`, vLLM's --tool-call-parser)."""
