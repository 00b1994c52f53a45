"""Memory: conversion peaks (safetensors and GGUF sources), training peaks against their estimate, GPU fit tables."""
