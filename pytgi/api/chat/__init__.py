"""What every chat API shares (OpenAI's chat and Responses, Anthropic's Messages): a chat body's engine
requests (`requests`), tool formats and their call parsers (`tools`, `tool_calls`), and reasoning
split from the answer (`reasoning`)."""
