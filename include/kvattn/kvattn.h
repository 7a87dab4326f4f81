// kvattn — the attention layer of an LLM serving engine. One include for the whole public API.
#pragma once

#include "kvattn/backend.h"
#include "kvattn/dtype.h"
#include "kvattn/error.h"
#include "kvattn/forward_batch.h"
#include "kvattn/kv_cache.h"
#include "kvattn/memory.h"
#include "kvattn/tensor.h"
