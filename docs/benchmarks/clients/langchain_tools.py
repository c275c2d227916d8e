"""LangChain's ChatOpenAI against a running pagoda server: `bind_tools` with its default
tool_choice (none given: "auto", which vLLM and pagoda take only with a tool-call parser), streamed
and not, `tool_choice="any"` (OpenAI's "required") and `with_structured_output`. Prints what
came back; a refused request raises. LangChain is no dependency of pagoda: use its own venv.

    python3 -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install langchain-openai
    .venv/bin/pagoda serve smollm2 --port 8311 --enable-auto-tool-choice --tool-call-parser hermes &
    /tmp/lcvenv/bin/python docs/benchmarks/clients/langchain_tools.py http://127.0.0.1:8311/v1
"""
import sys

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


class City(BaseModel):
    name: str
    country: str


llm = ChatOpenAI(base_url=sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8311/v1",
                 api_key="x", model="smollm2", temperature=0, max_tokens=120)
bound = llm.bind_tools([get_weather])
for question in ["What's the weather in Paris? Use the tool.", "Say hello."]:
    msg = bound.invoke(question)
    print(f"bind_tools, {question!r}: tool_calls {msg.tool_calls}, content {msg.content[:80]!r}")
chunks = list(bound.stream("What's the weather in Tokyo? Use the tool."))
whole = chunks[0]
for chunk in chunks[1:]:
    whole = whole + chunk
print(f"bind_tools streamed: {len(chunks)} chunks, tool_calls {whole.tool_calls}, content {whole.content[:80]!r}")
print("tool_choice any:", llm.bind_tools([get_weather], tool_choice="any").invoke("What's the weather in Paris?").tool_calls)
print("with_structured_output:", llm.with_structured_output(City).invoke("Name a city in France."))
