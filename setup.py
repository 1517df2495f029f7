from setuptools import find_packages, setup

setup(
    name="spark-estimator",
    version="0.1.0",
    description="Distributed PyTorch training as a Spark ML Estimator",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["spark_estimator", "spark_estimator.*"]),
    python_requires=">=3.10",
    entry_points={"console_scripts": ["spark-estimator-run = spark_estimator.launcher:main"]},
    install_requires=[
        "pyspark>=3.5",
        "torch>=2.2",
        "pyarrow>=14",
        "pandas>=2.2,<3",
        "numpy",
        "cloudpickle>=2.2",
        "fsspec>=2023.1",
        "tqdm>=4.60",
        "cryptography>=41",  # SealedStore: the AEAD that seals the rendezvous store
    ],
    extras_require={
        "petastorm": ["petastorm==0.13.1"],
        "connect": ["pyspark[connect]>=3.5"],
        "s3": ["s3fs>=2024.2"],
        # mlflow_logging and spark_estimator.mlflow (log, register, load: MLflow 3's models)
        "mlflow": ["mlflow-skinny>=3"],
        # mlflow models serve and a local tracking store too: mlflow-skinny cannot serve
        "serving": ["mlflow>=3"],
        "lightning": ["lightning>=2.0"],
        "tune": ["optuna>=4.0"],  # spark_estimator.tuning (OptunaSearch)
        # spark_estimator.decoding (decode_image; decode_images' JPEGs: simplejpeg), examples
        "vision": ["Pillow>=9.2", "simplejpeg>=1.8"],
        "text": ["tokenizers>=0.13.3", "transformers>=4.40"],  # the text and GPT-2 examples
        "notebooks": [
            "jupyterlab",
            "ipywidgets",
            "matplotlib",
            "scikit-learn",
            "lightning>=2.0",
            "optuna>=4.0",
        ],
        "examples": ["scikit-learn"],
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist",
            "scikit-learn",
            "ruff",
            "pyspark[connect]",
            "s3fs>=2024.2",
            "moto[server]",
            "mlflow>=3",  # serving (mlflow models serve) and the sqlite store's registry
            "lightning>=2.0",
            "optuna>=4.0",
            "tensorboard",
            "nbclient",
            "nbformat",
            "ipykernel",
            "ipywidgets",  # the fit's progress widget in Jupyter (tests/driver/test_monitor.py)
            "matplotlib",
            "Pillow>=9.2",
            "simplejpeg>=1.8",
            "tokenizers>=0.13.3",
            "transformers>=4.40",
            # lake tables built by the tests (Delta by delta-rs, Iceberg in a sqlite catalog)
            "deltalake>=1.0",
            "pyiceberg[sql-sqlite,pyarrow]>=0.9",
        ],
    },
)
