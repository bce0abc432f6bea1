"""Routes of this endpoint family (filled in next)."""

from fastapi import APIRouter


def build_router() -> APIRouter:
    return APIRouter()
