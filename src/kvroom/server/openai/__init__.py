"""The OpenAI API: protocol, prompts, sampling fields, response and stream formats, tools.

Nothing is imported here, so ``import kvroom.server.openai.protocol`` stays free of torch.
"""
