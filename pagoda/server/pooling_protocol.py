"""Pydantic models of the pooling routes, as vLLM shapes them: `/v1/embeddings` (OpenAI's
schema), `/pooling`, `/score` and `/rerank` (Jina's and Cohere's shape, as vLLM answers it).

Unknown fields are refused by name, as on the generation routes; `pooling_type` (LAST or MEAN)
is pagoda's extension (vLLM sets it per model).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagoda.pooling import PoolingType
from pagoda.server.protocol import OpenAIBaseModel, RequestModel, UsageInfo

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class PoolingFields(RequestModel):
    """What every pooling route takes besides its inputs."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0
    add_special_tokens: bool = True


class EmbeddingRequest(PoolingFields):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: PoolingType = "LAST"


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "encode"] = "encode"


class ScoreRequest(PoolingFields):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(PoolingFields):
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)


class ListResponse(OpenAIBaseModel):
    """What the embedding, pooling and score responses share; each adds its `data`."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    usage: UsageInfo


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(ListResponse):
    data: list[EmbeddingResponseData]


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(ListResponse):
    data: list[PoolingResponseData]


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ListResponse):
    data: list[ScoreResponseData]


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
