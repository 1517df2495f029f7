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
        "mlflow": ["mlflow-skinny>=2.10"],
        "lightning": ["lightning>=2.0"],
        "vision": ["Pillow>=9.2"],  # spark_estimator.decoding.decode_image, image examples
        "text": ["tokenizers>=0.13.3", "transformers>=4.40"],  # the text and GPT-2 examples
        "notebooks": ["jupyterlab", "ipywidgets", "matplotlib", "scikit-learn", "lightning>=2.0"],
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
            "mlflow-skinny>=2.10",
            "lightning>=2.0",
            "tensorboard",
            "nbclient",
            "nbformat",
            "ipykernel",
            "matplotlib",
            "Pillow>=9.2",
            "tokenizers>=0.13.3",
            "transformers>=4.40",
        ],
    },
)
