"""The API side's own chat language, which every chat API (OpenAI's chat and Responses, Anthropic's
Messages) translates into and out of: the chat request (`language`), its engine requests
(`requests`), output constraints (`constraints`), tool formats and their call parsers (`tools`,
`tool_calls`), and the answer read into reasoning, content and calls (`answer`, `reasoning`,
`harmony`). Nothing here imports an API's own module."""
